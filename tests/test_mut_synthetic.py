"""The built-in data (data=synthetic) is the same text for a seed in every version: runs on
it compare across versions, and the tiny model's tokenizer is trained on it. Written for
survivors of the mutation run (benchmarks/mutation/)."""

from __future__ import annotations

from finetune.synthetic import generate


def test_seed_0_gives_the_same_problems_with_each_kind_of_step():
    first, second = generate(2, seed=0)
    assert first == {"prompt": "Question: Jo has 4 coins. At the library, Jo gets 4 more coins. How many coins does Jo "
                               "have now?\nAnswer: ",
                     "completion": "4 + 4 = 8.\n#### 8"}
    # doubling (kind 2, under 200), giving away (kind 1), bringing (kind 3)
    assert second == {"prompt": "Question: Ivan has 58 pencils. Then the number of pencils doubles. Then the number of "
                                "pencils doubles. Ivan gives 16 pencils to Hana. Hana brings 1 pencils and gives them "
                                "all to Ivan. How many pencils does Ivan have now?\nAnswer: ",
                      "completion": "58 * 2 = 116. 116 * 2 = 232. 232 - 16 = 216. 216 + 1 = 217.\n#### 217"}

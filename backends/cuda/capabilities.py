"""What the cuda backend runs, without importing torch: the one list the config, the planner
and the runtime check against (tests/test_capabilities.py walks it against the runtime).

Adding an optimizer: its name here, its constructor in ``optimizers.OPTIMIZER_BUILDERS``, its state
bytes in ``memory.optimizer_state_bytes``, a YAML in conf/optim/, and a test.
"""

from finetune.backends.base import Capabilities

CAPABILITIES = Capabilities(
    name="cuda",
    methods=("lora", "dora", "qlora", "full"),
    optimizers=("adamw", "adam", "adamw_8bit", "paged_adamw_8bit", "paged_adamw", "adafactor", "sgd"),
    # precision: (weight dtype or None = as stored, autocast dtype or None)
    precisions={"auto": (None, None), "32-true": ("float32", None), "bf16-mixed": ("float32", "bfloat16"),
                "bf16-true": ("bfloat16", None), "16-mixed": ("float32", "float16")},
    attn_implementations=("auto", "sdpa", "eager", "flash_attention_2"),
    why_not={},
    nvml=True,  # CUDA devices have a driver-level view (NVML) beside the allocator
    cache_limit=False,  # torch's caching allocator has no cap on cached blocks to set
    strategies=("ddp", "fsdp"),  # under torchrun: replicated (gradient all-reduce) or FSDP2 fully_shard
    chunked_loss_with_compile=False,  # the compiled loss traces the whole logits (loss.compile_loss)
    # no [1, 1, T, T] mask under sdpa: a packed row runs per sample (varlen.py); eager builds one,
    # small beside its [B, H, T, T] scores
    packed_block_mask=False,
    gpu_device="cuda",  # paged optimizer state in unified memory; backend.device_map=auto splits layers
    adapter_format="peft",
    # the event's name since the governor first set limits on mlx; kept so runs' files compare
    limits_event="set_mlx_limits",
    framework="torch",
    install="backend=cuda needs torch: run `bash scripts/setup.sh` (or pip install '.[cuda]')",
)

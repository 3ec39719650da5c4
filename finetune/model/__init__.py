"""The model: where its weights come from, its description, the tiny model built here."""

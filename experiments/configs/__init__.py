"""Python config files: each defines `config`, a jaxlm.config.TrainConfig (or a function returning one)."""

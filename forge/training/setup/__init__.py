"""Set-up: the phases that build a run (config to checkpoint), what validation checks
beyond the config file, the loaders, an object store's claim, the guards a start arms."""

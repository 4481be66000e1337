"""Hugging Face interop: a forge model to and from the families transformers loads (one
``FamilySpec`` each, ``families``), the export (``export.py``), the import (``hf_config.py``
checks ``config.json``, ``hf_import.py`` reads the folder). Nothing here touches forge's own
checkpoints (``forge.checkpoint``): an import writes one through the caller."""

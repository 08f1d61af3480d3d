"""The decoder families, one file per Hugging Face model class. Each file holds everything that
makes its family (its `config.json` reader and writer, tensor names, residual design, layer
choices, presets) and registers its class (`models.config.registry`). Importing this package
imports every module in it, so a family added as a new file registers itself;
`docs/architecture.md` ("Adding a family") shows how one is added."""

import importlib
import pkgutil

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")

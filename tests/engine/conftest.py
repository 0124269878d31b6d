"""The engine's tests: swap/ and lora/'s pure parts with torch only, no ComfyUI on sys.path.
The repository is imported as the package `ringswap`, whatever its folder is called."""
import importlib.util
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

if "ringswap" not in sys.modules:
    spec = importlib.util.spec_from_file_location("ringswap", os.path.join(REPO, "__init__.py"),
                                                  submodule_search_locations=[REPO])
    pack = importlib.util.module_from_spec(spec)
    sys.modules["ringswap"] = pack
    spec.loader.exec_module(pack)

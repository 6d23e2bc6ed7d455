"""The examples import each other by name, as scripts in one folder do.

This repository runs pytest with --import-mode=importlib (pyproject.toml), which
does not put a test's folder on sys.path; in a project with pytest's default
import mode this file is not needed.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

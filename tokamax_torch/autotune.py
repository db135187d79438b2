"""``python -m tokamax_torch.autotune``: the autotuning command line (``tokamax_torch.autotuning.cli``).

Importing this module does not replace the function ``tokamax_torch.autotune``: the package
never lets a submodule import overwrite one of its public non-module names (see
``tokamax_torch/__init__.py``).
"""

import sys

from tokamax_torch.autotuning.cli import main

if __name__ == "__main__":
    sys.exit(main())

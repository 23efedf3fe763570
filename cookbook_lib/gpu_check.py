"""``python -m cookbook_lib.gpu_check``: the documented command for the GPU check, which lives in
:mod:`cookbook_lib.runtime.gpu_check`."""

import sys

from cookbook_lib.runtime.gpu_check import main

if __name__ == "__main__":
    sys.exit(main())

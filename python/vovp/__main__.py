"""``python -m vovp``: the ``vovp`` command-line client (``vovp --help``), the executable the
wheel installed beside this interpreter, or the first on PATH."""

import os
import shutil
import sys
import sysconfig


def main() -> None:
    bundled = os.path.join(sysconfig.get_path("scripts"), "vovp")
    cli = os.environ.get("VOVP_CLI_BIN") or (bundled if os.access(bundled, os.X_OK) else None)
    cli = cli or shutil.which("vovp")
    if cli is None:
        sys.exit("vovp: no vovp executable beside this interpreter or on PATH "
                 "(`pip install ./python` installs it)")
    os.execv(cli, [cli, *sys.argv[1:]])


if __name__ == "__main__":
    main()

"""`python -m pipeline support`: the support table (pipeline/support.py).

    python -m pipeline support                 # the table
    python -m pipeline support --markdown      # as Markdown: the README's table is this output
    python -m pipeline support --write-readme  # rewrite the README's table (between its archs-table markers)
"""
from __future__ import annotations

import argparse

from pipeline.paths import ROOT
from pipeline.support import readme_with_table, table


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pipeline support", description=__doc__.splitlines()[0])
    ap.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    ap.add_argument("--write-readme", action="store_true", help="rewrite the README's table")
    a = ap.parse_args(argv)
    if a.write_readme:
        readme = ROOT / "README.md"
        readme.write_text(readme_with_table(readme.read_text()))
        print(f"wrote the table into {readme}")
        return 0
    print(table(markdown=a.markdown))
    return 0

"""Verify a study artifact (.tar.gz or extracted folder) against its MANIFEST.json:
`python workflow/scripts/verify_archive.py ARTIFACT` exits 1 with one line per problem."""

import argparse
import sys

from common.artifact import verify


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artifact", help="artifact .tar.gz or an extracted artifact folder")
    args = ap.parse_args(argv)
    problems = verify(args.artifact)
    for p in problems:
        print(f"FAIL {p}")
    print(f"{args.artifact}: {len(problems)} problem(s)" if problems else f"{args.artifact}: OK")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())

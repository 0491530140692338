#!/usr/bin/env python3
"""`hf download` stand-in on a simulated node: the local model source instead of the Hub.

Same CLI shape as huggingface_hub's `hf download REPO --revision REV --local-dir DIR`; reads the
hub-cache layout (models--Owner--Name/snapshots/<sha>/, refs/<name>) under HF_HUB_CACHE. Files
already present with the right size are skipped, so an interrupted download resumes. Stdlib only.
"""

import argparse
import os
import shutil
import sys


def main(argv=None):
    ap = argparse.ArgumentParser(prog="hf")
    sub = ap.add_subparsers(dest="cmd", required=True)
    dl = sub.add_parser("download")
    dl.add_argument("repo_id")
    dl.add_argument("--revision", default="main")
    dl.add_argument("--local-dir", required=True)
    dl.add_argument("--quiet", action="store_true")
    args = ap.parse_args(argv)
    cache = os.environ.get("HF_HUB_CACHE")
    if not cache:
        print("hf: HF_HUB_CACHE is not set (simulated node without a model source)", file=sys.stderr)
        return 2
    root = os.path.join(cache, "models--" + args.repo_id.replace("/", "--"))
    if not os.path.isdir(root):
        print(f"Repository Not Found for url: .../api/models/{args.repo_id}/revision/{args.revision}.", file=sys.stderr)
        return 1
    rev = args.revision
    ref = os.path.join(root, "refs", rev)
    if os.path.isfile(ref):
        rev = open(ref).read().strip()
    snap = os.path.join(root, "snapshots", rev)
    if not os.path.isdir(snap):
        print(f"Revision Not Found for url: .../api/models/{args.repo_id}/revision/{args.revision}.", file=sys.stderr)
        return 1
    copied = skipped = 0
    for dirpath, _dirs, files in os.walk(snap):
        for name in sorted(files):
            src = os.path.join(dirpath, name)
            rel = os.path.relpath(src, snap)
            dst = os.path.join(args.local_dir, rel)
            if os.path.isfile(dst) and os.path.getsize(dst) == os.path.getsize(src):
                skipped += 1
                continue
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            shutil.copyfile(src, dst + ".incomplete")
            os.replace(dst + ".incomplete", dst)
            copied += 1
            if not args.quiet:
                print(f"Downloading {rel}", flush=True)
    if not args.quiet:
        print(f"Fetched {copied} files ({skipped} already complete) at revision {rev}", flush=True)
    print(os.path.abspath(args.local_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())

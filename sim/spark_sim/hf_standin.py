#!/usr/bin/env python3
"""`hf download` stand-in on a simulated node: the local model source instead of the Hub.

Same CLI shape as huggingface_hub's `hf download REPO [--revision REV] [--local-dir DIR]`; reads the
hub-cache layout (models--Owner--Name/snapshots/<sha>/, refs/<name>) under HF_HUB_CACHE, which on a
simulated node names the hub itself. Files already present with the same content are skipped, so an
interrupted download resumes. Stdlib only.

Without --local-dir (the runbook's `hf download Intel/...`, as install.sh runs it) the files land
in the user's own cache the way huggingface_hub lays it out: `~/.cache/huggingface/hub` (or
`$HF_HOME/hub`), `models--Owner--Name/snapshots/<commit sha>/<file>` and `refs/<revision>` holding
that sha; the snapshot path is printed last, as the real CLI does. (On a real machine
HF_HUB_CACHE would name that cache; here it names the hub, hence HF_HOME.)
"""

import argparse
import hashlib
import os
import shutil
import sys
import time


def write_local_dir_metadata(target, rel, rev, src):
    """What huggingface_hub writes beside a `--local-dir` download, one file per downloaded file:
    `<local_dir>/.cache/huggingface/download/<file>.metadata` holding the commit, the etag (an LFS
    file's sha256) and the time, plus a `.gitignore` of `*` in `.cache/huggingface`."""
    meta_root = os.path.join(target, ".cache", "huggingface")
    path = os.path.join(meta_root, "download", rel + ".metadata")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    ignore = os.path.join(meta_root, ".gitignore")
    if not os.path.exists(ignore):
        with open(ignore, "w") as fh:
            fh.write("*")
    with open(path, "w") as fh:
        fh.write(f"{rev}\n{sha256(src)}\n{time.time()}\n")


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def user_cache():
    home = os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface")
    return os.path.join(home, "hub")


def main(argv=None):
    ap = argparse.ArgumentParser(prog="hf")
    sub = ap.add_subparsers(dest="cmd", required=True)
    dl = sub.add_parser("download")
    dl.add_argument("repo_id")
    dl.add_argument("--revision", default="main")
    dl.add_argument("--local-dir", default=None)
    dl.add_argument("--quiet", action="store_true")
    args = ap.parse_args(argv)
    cache = os.environ.get("HF_HUB_CACHE")
    if not cache:
        print("hf: HF_HUB_CACHE is not set (simulated node without a model source)", file=sys.stderr)
        return 2
    folder = "models--" + args.repo_id.replace("/", "--")
    root = os.path.join(cache, folder)
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
    if args.local_dir:
        target = args.local_dir
    else:
        repo_cache = os.path.join(user_cache(), folder)
        target = os.path.join(repo_cache, "snapshots", rev)
        os.makedirs(os.path.join(repo_cache, "refs"), exist_ok=True)
        with open(os.path.join(repo_cache, "refs", args.revision), "w") as fh:
            fh.write(rev)
    copied = skipped = 0
    for dirpath, _dirs, files in os.walk(snap):
        for name in sorted(files):
            src = os.path.join(dirpath, name)
            rel = os.path.relpath(src, snap)
            dst = os.path.join(target, rel)
            # huggingface_hub skips a local file whose metadata names this commit and etag, or
            # (without metadata) whose sha256 is the file's etag: the same content, not the same size.
            if os.path.isfile(dst) and os.path.getsize(dst) == os.path.getsize(src) and sha256(dst) == sha256(src):
                skipped += 1
                if args.local_dir:
                    write_local_dir_metadata(target, rel, rev, src)
                continue
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            shutil.copyfile(src, dst + ".incomplete")
            os.replace(dst + ".incomplete", dst)
            if args.local_dir:
                write_local_dir_metadata(target, rel, rev, src)
            copied += 1
            if not args.quiet:
                print(f"Downloading {rel}", flush=True)
    if not args.quiet:
        print(f"Fetched {copied} files ({skipped} already complete) at revision {rev}", flush=True)
    print(os.path.abspath(target))
    return 0


if __name__ == "__main__":
    sys.exit(main())

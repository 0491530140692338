
def hub_snapshot(repo_id):
    """Local snapshot of an HF repo id (offline hub cache, like hf_hub_download's layout)."""
    if os.path.isdir(repo_id):
        return Path(repo_id)
    cache = os.environ.get("HF_HUB_CACHE") or os.path.join(
        os.environ.get("HF_HOME", os.path.expanduser("~/.cache/huggingface")), "hub")
    root = Path(cache) / ("models--" + repo_id.replace("/", "--"))
    ref = root / "refs" / "main"
    if not ref.is_file():
        raise FileNotFoundError("%s is not in the hub cache %s" % (repo_id, cache))
    return root / "snapshots" / ref.read_text().strip()

"""--hf-repo: GGUF files from the Hugging Face hub (or HF_ENDPOINT) into bloomery's download cache.

spec.py     `<repo>[@<rev>][:<quant>]` -> HfSpec (pure)
select.py   which files of a repo a quant names, split sets, the quants a repo has (pure)
errors.py   the named refusals
cache.py    the cache layout: refs, manifests, verified blobs, snapshot links
download.py one file: resumable ranged GET, sha256 (or git blob sha1) checked
fetch.py    the whole: hub (or cache when offline) -> local paths of every shard
"""

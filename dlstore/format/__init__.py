"""The shard format: tar shards, the dataset manifest, per-shard sample indexes, checksums.

A dataset is a folder of POSIX tars that `tar` and `webdataset` read, plus `index.json`.
See `docs/architecture.md` for the layout on the store.
"""

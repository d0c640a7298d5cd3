"""dlstore's lab: one shared runner and one module per question still asked.

Run each from the repository root, e.g. ``python -m benchmarks.peers --quick``.

* `runner`: interleaved rounds, the median and range, CPU and memory (psutil).
* `data`: generated JPEGs, their shards, copies in Swift.
* `pipelines`: the loaders compared (dlstore, webdataset, ImageFolder) and their timing.
* `store_side`: the local Swift, its WAN emulators, curl.
* `peers`: dlstore against webdataset and ImageFolder on one box.
* `cold`: a cold shard fetch against curl; cold loader epochs against warm ones.
* `cache_policy`: bytes fetched per epoch, LRU against plan-aware eviction.
* `gpu`: can dlstore feed the GPU; ``gpu_check.sh`` runs it on a lent GPU node.
* `engines`: dlstore's thread engine against SPDL and torchdata.nodes.
* `convert`: `dlstore convert` against ``tar cf``.
"""

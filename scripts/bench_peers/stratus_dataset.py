"""Read a Stratus dataset (what `ps-data ...` writes) with numpy.

A dataset is a folder (a `file://` bucket prefix) holding `manifest.json` and
the records of two splits, `train` and `test`. Every record is

    label: u32 little-endian, then the features, little-endian, each stored
    as the manifest's `feature_type`: f32 (the default when the field is
    absent), u8 or u16 (a text dataset's token ids)

so `record_bytes = 4 + width * features`. The manifest's `layout` says how the
records are cut into objects:

* `shards` (format 1, also manifests without a layout field): each split lists
  shard objects `{"path", "first", "count"}` in index order; a shard is
  `count` records back to back.
* `per_sample` (format 2): one object per sample, `train/00000123.bin`,
  holding exactly one record.

`load_split(root, "train")` returns `(features [n, features] float32 (token
ids converted),
labels [n] int64)` in global index order, checked against the manifest.
"""
import json
import os

import numpy as np


class DatasetError(Exception):
    pass


def _root_path(url):
    """A `file://dir` URL or a plain path to the dataset folder."""
    if url.startswith("file://"):
        return url[len("file://"):]
    if "://" in url:
        raise DatasetError(f"only file:// datasets can be read here, got {url}")
    return url


def read_manifest(url):
    root = _root_path(url)
    path = os.path.join(root, "manifest.json")
    try:
        with open(path, "rb") as f:
            manifest = json.load(f)
    except FileNotFoundError:
        raise DatasetError(f"no dataset at {root}: manifest.json not found") from None
    features = int(manifest["features"])
    kind = manifest.get("feature_type", "f32")
    if kind not in _FEATURE_TYPES:
        raise DatasetError(f"unknown feature_type {kind!r}")
    width = np.dtype(_FEATURE_TYPES[kind]).itemsize
    if int(manifest["record_bytes"]) != 4 + width * features:
        raise DatasetError(
            f"record_bytes {manifest['record_bytes']} does not match {features} {kind} features"
        )
    return manifest


_FEATURE_TYPES = {"f32": "<f4", "u8": "u1", "u16": "<u2"}


def _record_dtype(features, kind):
    return np.dtype([("label", "<u4"), ("features", _FEATURE_TYPES[kind], (features,))])


def load_split(url, split):
    """All samples of `split` ("train" or "test") in index order."""
    root = _root_path(url)
    manifest = read_manifest(url)
    features = int(manifest["features"])
    classes = int(manifest["classes"])
    info = manifest[split]
    n = int(info["num_samples"])
    dtype = _record_dtype(features, manifest.get("feature_type", "f32"))
    layout = manifest.get("layout", "shards")
    records = np.empty(n, dtype=dtype)
    if layout == "shards":
        at = 0
        for shard in info["shards"]:
            first, count = int(shard["first"]), int(shard["count"])
            if first != at:
                raise DatasetError(f"{split} shard {shard['path']} starts at {first}, expected {at}")
            data = np.fromfile(os.path.join(root, shard["path"]), dtype=dtype)
            if len(data) != count:
                raise DatasetError(
                    f"{shard['path']} holds {len(data)} records, the manifest says {count}"
                )
            records[at:at + count] = data
            at += count
        if at != n:
            raise DatasetError(f"{split} shards hold {at} records, the manifest says {n}")
    elif layout in ("per_sample", "per-sample"):
        for i in range(n):
            data = np.fromfile(os.path.join(root, split, f"{i:08}.bin"), dtype=dtype)
            if len(data) != 1:
                raise DatasetError(f"{split}/{i:08}.bin is not exactly one record")
            records[i] = data[0]
    else:
        raise DatasetError(f"unknown dataset layout {layout!r}")
    labels = records["label"].astype(np.int64)
    if n and labels.max() >= classes:
        raise DatasetError(f"{split} has a label >= {classes} classes")
    return np.ascontiguousarray(records["features"], dtype=np.float32), labels

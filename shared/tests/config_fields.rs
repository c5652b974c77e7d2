//! Every field of the cluster config is shown in a shipped config: the
//! fields of [`ClusterConfig`] (walked through its serialized defaults), the
//! types and fields of a `[[model.layers]]` table and of a
//! `[[model.tensors]]` entry (read from the names serde accepts), each in
//! some file of `configs/`; and `configs/reference.toml` names every field,
//! with a comment, at its default value.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use ps_shared::config::layers::LayerSpec;
use ps_shared::config::{ClusterConfig, TensorDecl};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The cluster configs of `configs/` (simulation files are another format).
fn shipped_configs() -> Vec<(PathBuf, toml::Table)> {
    let dir = repo().join("configs");
    let mut out = Vec::new();
    for entry in std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
        let path = entry.expect("a directory entry").path();
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if name.ends_with(".toml") && !name.starts_with("simulate") {
            let text = std::fs::read_to_string(&path)
                .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            let table: toml::Table = text
                .parse()
                .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            out.push((path, table));
        }
    }
    out.sort_by(|a, b| a.0.cmp(&b.0));
    assert!(
        out.len() >= 8,
        "too few configs in {}: {out:?}",
        dir.display()
    );
    out
}

/// Dotted paths of every key under `table`; the entries of an array of
/// tables are walked as `key[]`.
fn field_paths(table: &toml::Table, prefix: &str, out: &mut BTreeSet<String>) {
    for (key, value) in table {
        let path = format!("{prefix}{key}");
        match value {
            toml::Value::Table(t) => field_paths(t, &format!("{path}."), out),
            toml::Value::Array(items) if items.iter().any(toml::Value::is_table) => {
                for item in items.iter().filter_map(toml::Value::as_table) {
                    field_paths(item, &format!("{path}[]."), out);
                }
            }
            _ => {}
        }
        out.insert(path);
    }
}

fn default_paths() -> BTreeSet<String> {
    let defaults = toml::Table::try_from(ClusterConfig::default()).expect("the defaults serialize");
    let mut paths = BTreeSet::new();
    field_paths(&defaults, "", &mut paths);
    // Sanity: the walk reaches the nested sections.
    for nested in [
        "model.gpt.vocab",
        "data.augment.pad",
        "optimizer.schedule.kind",
    ] {
        assert!(paths.contains(nested), "{nested} not in {paths:?}");
    }
    paths
}

/// The names serde lists after "expected" in an unknown-variant or
/// unknown-field error (`expected one of `a`, `b``, `expected `a` or `b``;
/// none for "there are no fields").
fn expected_names(error: &str) -> Vec<String> {
    let Some((_, rest)) = error.split_once("expected") else {
        return Vec::new();
    };
    rest.split('`')
        .skip(1)
        .step_by(2)
        .map(str::to_string)
        .collect()
}

/// Every layer type, with the fields its table accepts.
fn layer_types() -> Vec<(String, Vec<String>)> {
    let err = toml::from_str::<LayerSpec>("type = \"no-such-layer\"")
        .expect_err("an unknown layer type is refused")
        .to_string();
    let types = expected_names(&err);
    assert!(types.len() >= 10, "layer types from {err:?}: {types:?}");
    types
        .into_iter()
        .map(|t| {
            let probe = format!("type = \"{t}\"\nno_such_field = 1\n");
            // A type without fields (relu, flatten, ...) parses: serde does
            // not check the other keys of a tagged unit variant.
            let fields = match toml::from_str::<LayerSpec>(&probe) {
                Ok(_) => Vec::new(),
                Err(e) => {
                    let err = e.to_string();
                    assert!(err.contains("no_such_field"), "{t}: {err}");
                    expected_names(&err)
                }
            };
            (t, fields)
        })
        .collect()
}

#[test]
fn every_config_field_is_in_a_shipped_config() {
    let mut shown = BTreeSet::new();
    for (_, table) in shipped_configs() {
        field_paths(&table, "", &mut shown);
    }
    let missing: Vec<_> = default_paths().difference(&shown).cloned().collect();
    assert!(
        missing.is_empty(),
        "config fields in no file of configs/: {missing:?} (add them to configs/reference.toml)"
    );

    // [[model.tensors]] entries (kind = "custom").
    let err = toml::from_str::<TensorDecl>("no_such_field = 1")
        .expect_err("an unknown tensor field is refused")
        .to_string();
    let fields = expected_names(&err);
    assert!(fields.len() >= 2, "tensor fields from {err:?}: {fields:?}");
    for f in fields {
        let path = format!("model.tensors[].{f}");
        assert!(shown.contains(&path), "{path} is in no file of configs/");
    }
}

#[test]
fn every_layer_type_and_field_is_in_a_shipped_config() {
    // (type, field) pairs of every [[model.layers]] table shipped.
    let mut shown: BTreeSet<(String, String)> = BTreeSet::new();
    for (path, table) in shipped_configs() {
        let layers = table
            .get("model")
            .and_then(|m| m.get("layers"))
            .and_then(toml::Value::as_array);
        for layer in layers.into_iter().flatten() {
            let layer = layer.as_table().expect("a [[model.layers]] table");
            let kind = layer
                .get("type")
                .and_then(toml::Value::as_str)
                .unwrap_or_else(|| panic!("{}: a layer without a type", path.display()));
            shown.insert((kind.to_string(), String::new()));
            for key in layer.keys().filter(|k| *k != "type") {
                shown.insert((kind.to_string(), key.clone()));
            }
        }
    }
    for (kind, fields) in layer_types() {
        assert!(
            shown.contains(&(kind.clone(), String::new())),
            "no shipped config has a layer of type = \"{kind}\""
        );
        for field in fields {
            assert!(
                shown.contains(&(kind.clone(), field.clone())),
                "no shipped config sets `{field}` on a layer of type = \"{kind}\""
            );
        }
    }
}

#[test]
fn reference_config_names_every_field_at_its_default_with_a_comment() {
    let path = repo().join("configs/reference.toml");
    let reference =
        ClusterConfig::load(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    assert!(
        reference == ClusterConfig::default(),
        "configs/reference.toml differs from the defaults: it must show each field at its default"
    );
    let text = std::fs::read_to_string(&path).expect("reference.toml");
    let table: toml::Table = text.parse().expect("reference.toml parses");
    let mut named = BTreeSet::new();
    field_paths(&table, "", &mut named);
    let missing: Vec<_> = default_paths().difference(&named).cloned().collect();
    assert!(
        missing.is_empty(),
        "configs/reference.toml lacks {missing:?}"
    );

    // Each `key = value` line carries its own comment.
    let mut section = String::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        if line.starts_with('[') {
            section = line
                .split(']')
                .next()
                .unwrap_or("")
                .trim_start_matches('[')
                .to_string();
            continue;
        }
        let key = line.split('=').next().unwrap_or("").trim();
        assert!(
            line.contains(" # "),
            "configs/reference.toml line {}: {section}.{key} has no comment",
            i + 1
        );
    }
}

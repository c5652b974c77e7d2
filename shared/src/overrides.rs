//! Config overrides from the environment: `STRATUS__SECTION__FIELD=value`
//! sets `[section] field = value` before the config is deserialised and
//! validated, so an override is checked exactly as the file's own value.
//!
//! A double underscore separates the path segments (field names use single
//! underscores: `STRATUS__TRAINING__METRICS_DIR` is `training.metrics_dir`),
//! and the segments are matched in lower case. The value is read as a TOML
//! value (`0.05`, `true`, `[64, 32]`, `{ kind = "cosine" }`); a value that
//! is not one, or any value of a text field, is taken as the text itself.
//! A variable that names no config field is an error naming the variable.
//! The single-underscore `STRATUS_*` variables (`STRATUS_CONFIG`,
//! `STRATUS_TOKEN`, `STRATUS_RANK`, ...) are not overrides.
//!
//! ```
//! use ps_shared::overrides::Override;
//! let vars = [("STRATUS__OPTIMIZER__LR".to_string(), "0.05".to_string())];
//! let found = Override::from_vars(vars).unwrap();
//! assert_eq!(found[0].path, ["optimizer", "lr"]);
//! ```

use std::path::Path;

use crate::config::{ClusterConfig, ConfigError};

/// What every override variable starts with.
pub const PREFIX: &str = "STRATUS__";

/// Where the config comes from: a file, or the embedded development config.
#[derive(Debug, Clone, Copy)]
pub enum ConfigSource<'a> {
    /// `--config FILE` (or `STRATUS_CONFIG`).
    File(&'a Path),
    /// `--dev`: the embedded `configs/local.toml`.
    Dev,
}

/// One `STRATUS__...` variable.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Override {
    /// The variable's name, as set.
    pub var: String,
    /// The config path it sets, lower case (`["optimizer", "lr"]`).
    pub path: Vec<String>,
    /// The value, as set.
    pub value: String,
}

impl Override {
    /// The overrides among `vars` (other variables are skipped), sorted by
    /// variable name; a malformed name (an empty segment) is an error.
    pub fn from_vars(
        vars: impl IntoIterator<Item = (String, String)>,
    ) -> Result<Vec<Override>, ConfigError> {
        let mut found = Vec::new();
        for (var, value) in vars {
            let Some(rest) = var.strip_prefix(PREFIX) else {
                continue;
            };
            let path: Vec<String> = rest.split("__").map(|s| s.to_ascii_lowercase()).collect();
            if path.iter().any(|s| s.is_empty()) {
                return Err(ConfigError::Override {
                    var,
                    message: "expected STRATUS__SECTION__FIELD (segments separated by a double underscore, none empty)".into(),
                });
            }
            found.push(Override { var, path, value });
        }
        found.sort_by(|a, b| a.var.cmp(&b.var));
        Ok(found)
    }

    /// The overrides in this process's environment. A `STRATUS__` variable
    /// whose name or value is not UTF-8 is an error naming it.
    pub fn from_env() -> Result<Vec<Override>, ConfigError> {
        let mut vars = Vec::new();
        for (name, value) in std::env::vars_os() {
            let lossy = name.to_string_lossy();
            if !lossy.starts_with(PREFIX) {
                continue;
            }
            match (name.clone().into_string(), value.into_string()) {
                (Ok(n), Ok(v)) => vars.push((n, v)),
                _ => {
                    return Err(ConfigError::Override {
                        var: lossy.into_owned(),
                        message: "the name or the value is not UTF-8".into(),
                    })
                }
            }
        }
        Self::from_vars(vars)
    }

    /// The dotted config path (`optimizer.lr`).
    pub fn field(&self) -> String {
        self.path.join(".")
    }
}

/// Load the config from `source` with `overrides` applied, then validate
/// it. Without overrides this is [`ClusterConfig::load`] (or the embedded
/// config).
pub fn load(
    source: ConfigSource<'_>,
    overrides: &[Override],
) -> Result<ClusterConfig, ConfigError> {
    let (text, origin) = match source {
        ConfigSource::File(path) => (
            std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
                path: path.to_path_buf(),
                source,
            })?,
            path.display().to_string(),
        ),
        ConfigSource::Dev => (
            crate::config::DEFAULT_CONFIG.to_string(),
            "configs/local.toml (embedded)".to_string(),
        ),
    };
    ClusterConfig::parse_with(&text, &origin, overrides, apply)
}

/// The config of a binary's command line: `--config FILE` (or
/// `STRATUS_CONFIG`), or `--dev` for the embedded development config,
/// with this process's `STRATUS__...` overrides applied. Neither, or both,
/// is a config error saying what to pass. `--dev` is logged as a warning.
pub fn load_cli(config: Option<&Path>, dev: bool) -> Result<ClusterConfig, ConfigError> {
    let source = match (config, dev) {
        (Some(path), false) => ConfigSource::File(path),
        (None, true) => ConfigSource::Dev,
        (Some(path), true) => {
            return Err(ConfigError::Source(format!(
                "both --dev and --config {} (or STRATUS_CONFIG) given: pass one",
                path.display()
            )))
        }
        (None, false) => {
            return Err(ConfigError::Source(
                "no config given: pass --config FILE (or set STRATUS_CONFIG), or --dev for the embedded development config (configs/local.toml)".into(),
            ))
        }
    };
    let overrides = Override::from_env()?;
    if dev {
        tracing::warn!("--dev: using the embedded development config configs/local.toml (a local test cluster on 127.0.0.1, not for a real cluster)");
    }
    for o in &overrides {
        tracing::info!("config override {}: {} = {}", o.var, o.field(), o.value);
    }
    load(source, &overrides)
}

/// Set each override in `doc`, the config file as a TOML table. Every path
/// must name a field of the config (a table on the way, a field at the end).
pub fn apply(doc: &mut toml::Table, overrides: &[Override]) -> Result<(), ConfigError> {
    if overrides.is_empty() {
        return Ok(());
    }
    let schema =
        toml::Table::try_from(ClusterConfig::default()).map_err(|e| ConfigError::Parse {
            origin: "the config's fields".into(),
            message: e.to_string(),
        })?;
    for o in overrides {
        let value = typed_value(o, &schema)?;
        set(doc, &o.path, value).map_err(|message| ConfigError::Override {
            var: o.var.clone(),
            message,
        })?;
    }
    Ok(())
}

/// The override's value, typed by the field it sets: text fields take the
/// text as given (a quoted TOML string is unquoted), others a TOML value,
/// falling back to text.
fn typed_value(o: &Override, schema: &toml::Table) -> Result<toml::Value, ConfigError> {
    let unknown = |at: usize| ConfigError::Override {
        var: o.var.clone(),
        message: if at == 0 {
            format!(
                "no config section or field `{}` (sections: {})",
                o.path[0],
                schema.keys().cloned().collect::<Vec<_>>().join(", ")
            )
        } else {
            format!(
                "`{}` has no field `{}` (config path {})",
                o.path[..at].join("."),
                o.path[at],
                o.field()
            )
        },
    };
    let mut table = schema;
    let mut field = None;
    for (i, segment) in o.path.iter().enumerate() {
        let Some(value) = table.get(segment) else {
            return Err(unknown(i));
        };
        if i + 1 == o.path.len() {
            field = Some(value);
        } else {
            match value {
                toml::Value::Table(t) => table = t,
                _ => {
                    return Err(ConfigError::Override {
                        var: o.var.clone(),
                        message: format!(
                            "`{}` is a value, not a section: it has no field `{}`",
                            o.path[..=i].join("."),
                            o.path[i + 1]
                        ),
                    })
                }
            }
        }
    }
    let parsed = parse_value(&o.value);
    Ok(match (field, parsed) {
        (Some(toml::Value::String(_)), Some(toml::Value::String(s))) => toml::Value::String(s),
        (Some(toml::Value::String(_)), _) | (_, None) => toml::Value::String(o.value.clone()),
        (_, Some(v)) => v,
    })
}

/// `text` as one TOML value, if it is one.
fn parse_value(text: &str) -> Option<toml::Value> {
    let doc: toml::Table = toml::from_str(&format!("v = {text}")).ok()?;
    doc.get("v").cloned()
}

/// Set `path` in `doc`, creating the sections on the way that the file
/// leaves out.
fn set(doc: &mut toml::Table, path: &[String], value: toml::Value) -> Result<(), String> {
    let (last, sections) = path.split_last().ok_or("an empty config path")?;
    let mut table = doc;
    for (i, segment) in sections.iter().enumerate() {
        let entry = table
            .entry(segment.clone())
            .or_insert_with(|| toml::Value::Table(toml::Table::new()));
        table = match entry {
            toml::Value::Table(t) => t,
            _ => {
                return Err(format!(
                    "the config file sets `{}` to a value, not a section",
                    path[..=i].join(".")
                ))
            }
        };
    }
    table.insert(last.clone(), value);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ScheduleKind;

    fn overrides(pairs: &[(&str, &str)]) -> Vec<Override> {
        Override::from_vars(pairs.iter().map(|(a, b)| (a.to_string(), b.to_string()))).unwrap()
    }

    fn dev(pairs: &[(&str, &str)]) -> Result<ClusterConfig, ConfigError> {
        load(ConfigSource::Dev, &overrides(pairs))
    }

    #[test]
    fn numbers_bools_and_text_reach_their_fields() {
        let base = ClusterConfig::embedded_default().unwrap();
        let cfg = dev(&[
            ("STRATUS__OPTIMIZER__LR", "0.0625"),
            ("STRATUS__TRAINING__METRICS_DIR", "runs/over"),
            ("STRATUS__CLUSTER__TOKEN", "123456789"),
            ("STRATUS_RANK", "3"),
            ("STRATUS_TOKEN_FILE", "x"),
        ])
        .unwrap();
        assert_eq!(cfg.optimizer.lr, 0.0625);
        assert_eq!(cfg.training.metrics_dir, "runs/over");
        assert_eq!(cfg.cluster.token, "123456789");
        assert_ne!(base.optimizer.lr, cfg.optimizer.lr);
        assert_eq!(cfg.model, base.model);
    }

    #[test]
    fn an_enum_and_an_array_are_set_and_validated() {
        let cfg = dev(&[
            ("STRATUS__OPTIMIZER__SCHEDULE__KIND", "cosine"),
            ("STRATUS__OPTIMIZER__SCHEDULE__TOTAL_STEPS", "100"),
        ])
        .unwrap();
        assert_eq!(cfg.optimizer.schedule.kind, ScheduleKind::Cosine);
        let err = dev(&[("STRATUS__OPTIMIZER__SCHEDULE__KIND", "cosinus")])
            .unwrap_err()
            .to_string();
        assert!(err.contains("STRATUS__OPTIMIZER__SCHEDULE__KIND"), "{err}");
        let cfg = dev(&[("STRATUS__MODEL__HIDDEN", "[32, 16]")]).unwrap();
        assert_eq!(cfg.model.hidden, vec![32, 16]);
        let err = dev(&[("STRATUS__OPTIMIZER__LR", "fast")])
            .unwrap_err()
            .to_string();
        assert!(err.contains("STRATUS__OPTIMIZER__LR"), "{err}");
    }

    #[test]
    fn an_unknown_field_or_section_names_the_variable() {
        let err = dev(&[("STRATUS__OPTIMIZER__LRR", "0.1")])
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("STRATUS__OPTIMIZER__LRR")
                && err.contains("`optimizer` has no field `lrr`"),
            "{err}"
        );
        let err = dev(&[("STRATUS__OPTIMIZR__LR", "0.1")])
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("STRATUS__OPTIMIZR__LR") && err.contains("`optimizr`"),
            "{err}"
        );
        let err = dev(&[("STRATUS__OPTIMIZER__LR__X", "0.1")])
            .unwrap_err()
            .to_string();
        assert!(err.contains("not a section"), "{err}");
        let err = Override::from_vars([("STRATUS__TRAINING____LR".into(), "1".into())])
            .unwrap_err()
            .to_string();
        assert!(err.contains("STRATUS__TRAINING____LR"), "{err}");
    }

    #[test]
    fn single_underscore_variables_are_not_overrides() {
        let found = overrides(&[
            ("STRATUS_CONFIG", "a.toml"),
            ("STRATUS_TOKEN", "t"),
            ("STRATUS_RANK", "1"),
            ("STRATUS__SERVER__HEARTBEAT_SECS", "2"),
        ]);
        assert_eq!(found.len(), 1);
        assert_eq!(found[0].field(), "server.heartbeat_secs");
    }

    #[test]
    fn a_file_without_the_section_gets_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.toml");
        std::fs::write(
            &path,
            "[cluster]\nworkers = 2\nservers = [\"127.0.0.1:7400\"]\n",
        )
        .unwrap();
        let cfg = load(
            ConfigSource::File(&path),
            &overrides(&[("STRATUS__TRAINING__EPOCHS", "7")]),
        )
        .unwrap();
        assert_eq!(cfg.training.epochs, 7);
        assert_eq!(cfg.cluster.workers, 2);
    }
}

//! Static checks of the Kubernetes deployment in `deploy/kubernetes`.
//!
//! No cluster is needed: every YAML file is parsed, and each kustomization
//! (the default one, `overlays/gpu`, `overlays/scale`) is built by a small
//! resolver of the kustomize features the directory uses: `resources`
//! (files and directories), `configMapGenerator` (`files`, `behavior:
//! replace`), `patches` (strategic-merge files; lists of named items merge by
//! name), `images` and `namespace`. Generated ConfigMaps keep their plain
//! names (kustomize adds a content hash and rewrites the references; the
//! checks follow the references, so they hold either way, and when `kubectl`
//! is installed its own build is checked too).
//!
//! The checks on a built deployment, each with a test that breaks it:
//! * the cluster config in the ConfigMap the pods mount parses and validates
//!   with `ps_shared::config`;
//! * `cluster.servers` lists exactly the StatefulSet's pods through its
//!   headless Service (`ps-server-N.ps-server[.NS[.svc[.cluster.local]]]`),
//!   with the port the container and the Service expose, and the server
//!   takes its index from its pod;
//! * `cluster.workers` equals the worker Job's `completions` and
//!   `parallelism`, the Job is Indexed, and the worker's rank comes from
//!   `JOB_COMPLETION_INDEX`;
//! * every Secret and ConfigMap a pod refers to is defined, or named in the
//!   list of Secrets the user creates (docs/deploy.md);
//! * every image is the one the Dockerfile and docker-compose.yml build
//!   (`stratus`, any tag);
//! * the PodDisruptionBudget selects the server pods and no worker pod;
//! * the GPU overlay gives the worker container `nvidia.com/gpu` and a cuda
//!   device; the base asks for no GPU.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use ps_shared::config::ClusterConfig;
use serde::Deserialize;
use serde_yaml_ng::{Mapping, Value};

const SERVER_SET: &str = "ps-server";
const WORKER_JOB: &str = "ps-worker";
const GPU: &str = "nvidia.com/gpu";
const INDEX_ANNOTATION: &str = "metadata.annotations['batch.kubernetes.io/job-completion-index']";
const POD_INDEX_LABEL: &str = "metadata.labels['apps.kubernetes.io/pod-index']";
/// The section of docs/deploy.md that lists the Secrets the user creates.
const USER_SECRETS_HEADING: &str = "### Secrets you create";

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the workspace root")
        .to_path_buf()
}

fn deploy() -> PathBuf {
    repo().join("deploy/kubernetes")
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()))
}

/// Every document of a YAML stream; empty documents are left out.
fn parse_docs(text: &str, origin: &str) -> Result<Vec<Value>, String> {
    let mut docs = Vec::new();
    for (i, de) in serde_yaml_ng::Deserializer::from_str(text).enumerate() {
        let doc = Value::deserialize(de).map_err(|e| format!("{origin}, document {i}: {e}"))?;
        if !doc.is_null() {
            docs.push(doc);
        }
    }
    Ok(docs)
}

fn yaml_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let mut entries: Vec<_> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("listing {}: {e}", dir.display()))
        .map(|e| e.expect("a directory entry").path())
        .collect();
    entries.sort();
    for path in entries {
        if path.is_dir() {
            yaml_files(&path, out);
        } else if matches!(
            path.extension().and_then(|e| e.to_str()),
            Some("yaml" | "yml")
        ) {
            out.push(path);
        }
    }
}

// ---------------------------------------------------------------- values

fn get<'a>(v: &'a Value, path: &str) -> &'a Value {
    static NULL: Value = Value::Null;
    path.split('.')
        .try_fold(v, |v, key| v.get(key))
        .unwrap_or(&NULL)
}

fn str_at<'a>(v: &'a Value, path: &str) -> &'a str {
    get(v, path).as_str().unwrap_or("")
}

fn seq_at<'a>(v: &'a Value, path: &str) -> &'a [Value] {
    get(v, path).as_sequence().map(Vec::as_slice).unwrap_or(&[])
}

fn kind(v: &Value) -> &str {
    str_at(v, "kind")
}

fn name(v: &Value) -> &str {
    str_at(v, "metadata.name")
}

fn find<'a>(objects: &'a [Value], k: &str, n: &str) -> Option<&'a Value> {
    objects.iter().find(|o| kind(o) == k && name(o) == n)
}

fn find_mut<'a>(objects: &'a mut [Value], k: &str, n: &str) -> &'a mut Value {
    objects
        .iter_mut()
        .find(|o| kind(o) == k && name(o) == n)
        .unwrap_or_else(|| panic!("no {k} {n}"))
}

fn yaml(text: &str) -> Value {
    serde_yaml_ng::from_str(text).expect("valid YAML")
}

/// A mutable child of a mapping, created (as an empty mapping) when absent.
fn child<'a>(v: &'a mut Value, key: &str) -> &'a mut Value {
    if !v.is_mapping() {
        *v = Value::Mapping(Mapping::new());
    }
    let map = v.as_mapping_mut().expect("a mapping");
    map.entry(Value::from(key))
        .or_insert_with(|| Value::Mapping(Mapping::new()))
}

fn labels(v: &Value) -> Vec<(String, String)> {
    v.as_mapping()
        .map(|m| {
            m.iter()
                .map(|(k, v)| {
                    let s = |x: &Value| x.as_str().map(str::to_string).unwrap_or_default();
                    (s(k), s(v))
                })
                .collect()
        })
        .unwrap_or_default()
}

/// Whether every label of `selector` is among `labels`.
fn selects(selector: &Value, pod_labels: &Value) -> bool {
    let want = labels(selector);
    let have = labels(pod_labels);
    !want.is_empty() && want.iter().all(|l| have.contains(l))
}

// ------------------------------------------------------------- kustomize

/// Strategic merge: mappings merge key by key, lists of mappings that all
/// have a `name` merge item by item on it, anything else is replaced.
fn merge(base: &mut Value, patch: &Value) {
    fn named(items: &[Value]) -> bool {
        !items.is_empty() && items.iter().all(|i| i.get("name").is_some())
    }
    match patch {
        Value::Mapping(p) if base.is_mapping() => {
            let b = base.as_mapping_mut().expect("a mapping");
            for (k, v) in p {
                match b.get_mut(k) {
                    Some(old) => merge(old, v),
                    None => {
                        b.insert(k.clone(), v.clone());
                    }
                }
            }
        }
        Value::Sequence(p) if named(p) && base.as_sequence().is_some_and(|b| named(b)) => {
            let b = base.as_sequence_mut().expect("a sequence");
            for item in p {
                match b.iter_mut().find(|o| o.get("name") == item.get("name")) {
                    Some(old) => merge(old, item),
                    None => b.push(item.clone()),
                }
            }
        }
        _ => *base = patch.clone(),
    }
}

/// `repo[:tag]` or `repo@digest` without the tag or digest.
fn image_repo(image: &str) -> &str {
    let image = image.split('@').next().unwrap_or(image);
    match image.rfind(':') {
        Some(i) if !image[i..].contains('/') => &image[..i],
        _ => image,
    }
}

fn containers_mut(object: &mut Value) -> Vec<&mut Value> {
    let mut out = Vec::new();
    if let Some(spec) = object
        .get_mut("spec")
        .and_then(|s| s.get_mut("template"))
        .and_then(|t| t.get_mut("spec"))
        .and_then(Value::as_mapping_mut)
    {
        for (k, list) in spec.iter_mut() {
            if matches!(k.as_str(), Some("containers" | "initContainers")) {
                if let Some(list) = list.as_sequence_mut() {
                    out.extend(list.iter_mut());
                }
            }
        }
    }
    out
}

/// Build the kustomization in `dir` into its list of objects.
fn build(dir: &Path) -> Result<Vec<Value>, String> {
    let path = dir.join("kustomization.yaml");
    let text = std::fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))?;
    let k = parse_docs(&text, &path.display().to_string())?
        .pop()
        .ok_or_else(|| format!("{} is empty", path.display()))?;
    let here = |what: &str| format!("{} ({what})", path.display());

    let mut objects = Vec::new();
    for r in seq_at(&k, "resources") {
        let r = dir.join(
            r.as_str()
                .ok_or_else(|| here("a resource is not a string"))?,
        );
        if r.is_dir() {
            objects.extend(build(&r)?);
        } else {
            let text = std::fs::read_to_string(&r).map_err(|e| format!("{}: {e}", r.display()))?;
            objects.extend(parse_docs(&text, &r.display().to_string())?);
        }
    }

    for generator in seq_at(&k, "configMapGenerator") {
        let cm_name = str_at(generator, "name");
        let mut data = Mapping::new();
        for f in seq_at(generator, "files") {
            let f = f
                .as_str()
                .ok_or_else(|| here("a generator file is not a string"))?;
            let (key, file) = f
                .split_once('=')
                .unwrap_or_else(|| (f.rsplit('/').next().expect("a file name"), f));
            let file = dir.join(file);
            let content =
                std::fs::read_to_string(&file).map_err(|e| format!("{}: {e}", file.display()))?;
            data.insert(Value::from(key), Value::from(content));
        }
        let existing = objects
            .iter()
            .position(|o| kind(o) == "ConfigMap" && name(o) == cm_name);
        match (str_at(generator, "behavior"), existing) {
            ("replace", Some(i)) => *child(&mut objects[i], "data") = Value::Mapping(data),
            ("merge", Some(i)) => merge(child(&mut objects[i], "data"), &Value::Mapping(data)),
            ("" | "create", None) => {
                let mut cm = yaml("{apiVersion: v1, kind: ConfigMap, metadata: {}}");
                *child(child(&mut cm, "metadata"), "name") = Value::from(cm_name);
                *child(&mut cm, "data") = Value::Mapping(data);
                objects.push(cm);
            }
            (behavior, _) => {
                return Err(here(&format!(
                    "configMapGenerator {cm_name}: behavior `{behavior}` does not fit what the resources define"
                )))
            }
        }
    }

    for p in seq_at(&k, "patches") {
        let file = dir.join(str_at(p, "path"));
        if str_at(p, "path").is_empty() || get(p, "target").is_mapping() {
            return Err(here(
                "only `patches: - path: FILE` strategic-merge patches are resolved",
            ));
        }
        let text =
            std::fs::read_to_string(&file).map_err(|e| format!("{}: {e}", file.display()))?;
        for patch in parse_docs(&text, &file.display().to_string())? {
            let target = objects
                .iter_mut()
                .find(|o| kind(o) == kind(&patch) && name(o) == name(&patch))
                .ok_or_else(|| {
                    format!(
                        "{}: no {} {} to patch",
                        file.display(),
                        kind(&patch),
                        name(&patch)
                    )
                })?;
            merge(target, &patch);
        }
    }

    for image in seq_at(&k, "images") {
        let from = str_at(image, "name");
        for o in objects.iter_mut() {
            for c in containers_mut(o) {
                let Some(old) = c.get("image").and_then(Value::as_str).map(str::to_string) else {
                    continue;
                };
                if image_repo(&old) != from {
                    continue;
                }
                let repo = match str_at(image, "newName") {
                    "" => image_repo(&old).to_string(),
                    n => n.to_string(),
                };
                let old_tag = old.strip_prefix(image_repo(&old)).unwrap_or("");
                let new = match str_at(image, "newTag") {
                    "" => format!("{repo}{old_tag}"),
                    t => format!("{repo}:{t}"),
                };
                *child(c, "image") = Value::from(new);
            }
        }
    }

    if let Some(ns) = get(&k, "namespace").as_str() {
        for o in objects.iter_mut().filter(|o| kind(o) != "Namespace") {
            *child(child(o, "metadata"), "namespace") = Value::from(ns);
        }
    }
    Ok(objects)
}

// ---------------------------------------------------------------- checks

/// What the checks need from outside the manifests.
struct Context {
    /// The image repository the Dockerfile and docker-compose.yml build.
    image: String,
    /// The list of Secrets the user creates (docs/deploy.md).
    user_secrets: String,
}

impl Context {
    fn load() -> Self {
        let compose = read(&repo().join("docker-compose.yml"));
        let compose = parse_docs(&compose, "docker-compose.yml")
            .expect("docker-compose.yml parses")
            .remove(0);
        // image: ${STRATUS_IMAGE:-stratus:latest}
        let image = str_at(&compose, "x-stratus.image");
        let default = image
            .split_once(":-")
            .and_then(|(_, rest)| rest.strip_suffix('}'))
            .unwrap_or(image);
        let readme = read(&repo().join("docs/deploy.md"));
        let start = readme
            .find(USER_SECRETS_HEADING)
            .unwrap_or_else(|| panic!("docs/deploy.md has no `{USER_SECRETS_HEADING}` section"));
        let rest = &readme[start + USER_SECRETS_HEADING.len()..];
        let end = rest.find("\n#").unwrap_or(rest.len());
        Self {
            image: image_repo(default).to_string(),
            user_secrets: rest[..end].to_string(),
        }
    }
}

fn pod_spec(o: &Value) -> &Value {
    get(o, "spec.template.spec")
}

fn container<'a>(o: &'a Value, container_name: &str) -> Option<&'a Value> {
    seq_at(pod_spec(o), "containers")
        .iter()
        .find(|c| str_at(c, "name") == container_name)
}

fn env<'a>(c: &'a Value, var: &str) -> Option<&'a Value> {
    seq_at(c, "env").iter().find(|e| str_at(e, "name") == var)
}

/// command + args of a container.
fn argv(c: &Value) -> Vec<&str> {
    seq_at(c, "command")
        .iter()
        .chain(seq_at(c, "args"))
        .filter_map(Value::as_str)
        .collect()
}

/// The value of `--flag V` or `--flag=V` in `argv`.
fn flag<'a>(argv: &[&'a str], name: &str) -> Option<&'a str> {
    argv.iter().enumerate().find_map(|(i, a)| {
        if *a == name {
            argv.get(i + 1).copied()
        } else {
            a.strip_prefix(name).and_then(|v| v.strip_prefix('='))
        }
    })
}

/// The ConfigMap name and key behind the file `STRATUS_CONFIG` names.
fn config_source<'a>(o: &'a Value, c: &'a Value) -> Result<(&'a str, &'a str), String> {
    let path = env(c, "STRATUS_CONFIG")
        .and_then(|e| e.get("value"))
        .and_then(Value::as_str)
        .ok_or_else(|| format!("{} {}: no STRATUS_CONFIG value", kind(o), name(o)))?;
    let (mount, volume) = seq_at(c, "volumeMounts")
        .iter()
        .find_map(|m| {
            let dir = str_at(m, "mountPath").trim_end_matches('/');
            let key = path.strip_prefix(dir)?.strip_prefix('/')?;
            Some((key, str_at(m, "name")))
        })
        .ok_or_else(|| format!("{} {}: nothing mounted at {path}", kind(o), name(o)))?;
    let cm = seq_at(pod_spec(o), "volumes")
        .iter()
        .find(|v| str_at(v, "name") == volume)
        .map(|v| str_at(v, "configMap.name"))
        .filter(|n| !n.is_empty())
        .ok_or_else(|| {
            format!(
                "{} {}: volume {volume} is not a ConfigMap",
                kind(o),
                name(o)
            )
        })?;
    Ok((cm, mount))
}

/// The cluster config the pods of `o` read.
fn cluster_config(objects: &[Value], o: &Value, c: &Value) -> Result<ClusterConfig, String> {
    let (cm, key) = config_source(o, c)?;
    let text = objects
        .iter()
        .find(|x| kind(x) == "ConfigMap" && name(x) == cm)
        .and_then(|x| get(x, "data").get(key))
        .and_then(Value::as_str)
        .ok_or_else(|| format!("ConfigMap {cm} with key {key} is not defined"))?;
    ClusterConfig::from_toml_str(text).map_err(|e| format!("ConfigMap {cm} key {key}: {e}"))
}

/// Every Secret and ConfigMap a pod template refers to, as (kind, name).
fn references(o: &Value) -> Vec<(&'static str, String)> {
    let spec = pod_spec(o);
    let mut out = Vec::new();
    let mut add = |k: &'static str, v: &Value| {
        if let Some(n) = v.as_str() {
            out.push((k, n.to_string()));
        }
    };
    for v in seq_at(spec, "volumes") {
        add("ConfigMap", get(v, "configMap.name"));
        add("Secret", get(v, "secret.secretName"));
        for s in seq_at(v, "projected.sources") {
            add("ConfigMap", get(s, "configMap.name"));
            add("Secret", get(s, "secret.name"));
        }
    }
    for s in seq_at(spec, "imagePullSecrets") {
        add("Secret", get(s, "name"));
    }
    for c in seq_at(spec, "containers")
        .iter()
        .chain(seq_at(spec, "initContainers"))
    {
        for e in seq_at(c, "envFrom") {
            add("ConfigMap", get(e, "configMapRef.name"));
            add("Secret", get(e, "secretRef.name"));
        }
        for e in seq_at(c, "env") {
            add("ConfigMap", get(e, "valueFrom.configMapKeyRef.name"));
            add("Secret", get(e, "valueFrom.secretKeyRef.name"));
        }
    }
    out
}

/// Every rule the deployment must keep; the list of broken ones.
fn check(objects: &[Value], ctx: &Context) -> Vec<String> {
    let mut problems = Vec::new();
    let mut fail = |p: String| problems.push(p);

    for o in objects {
        if str_at(o, "apiVersion").is_empty() || kind(o).is_empty() || name(o).is_empty() {
            fail(format!(
                "an object lacks apiVersion, kind or metadata.name: {o:?}"
            ));
        }
    }

    let (Some(set), Some(job)) = (
        find(objects, "StatefulSet", SERVER_SET),
        find(objects, "Job", WORKER_JOB),
    ) else {
        fail(format!(
            "no StatefulSet {SERVER_SET} or no Job {WORKER_JOB}"
        ));
        return problems;
    };
    let (Some(server), Some(worker)) = (container(set, "ps-server"), container(job, "ps-worker"))
    else {
        fail("no container ps-server in the StatefulSet or ps-worker in the Job".into());
        return problems;
    };

    // The config both sides read.
    let cfg = match (
        cluster_config(objects, set, server),
        cluster_config(objects, job, worker),
    ) {
        (Ok(a), Ok(b)) if a == b => a,
        (Ok(_), Ok(_)) => {
            fail("servers and workers read different cluster configs".into());
            return problems;
        }
        (Err(e), _) | (_, Err(e)) => {
            fail(e);
            return problems;
        }
    };

    // Servers: one pod per cluster.servers entry, by its stable DNS name.
    let service_name = str_at(set, "spec.serviceName");
    let replicas = get(set, "spec.replicas").as_u64().unwrap_or(1);
    let ns = str_at(set, "metadata.namespace");
    match find(objects, "Service", service_name) {
        None => fail(format!(
            "the StatefulSet's serviceName `{service_name}` is no Service"
        )),
        Some(svc) => {
            if str_at(svc, "spec.clusterIP") != "None" {
                fail(format!(
                    "Service {service_name} is not headless (clusterIP: None)"
                ));
            }
            if !selects(
                get(svc, "spec.selector"),
                get(set, "spec.template.metadata.labels"),
            ) {
                fail(format!(
                    "Service {service_name} does not select the server pods"
                ));
            }
        }
    }
    if cfg.cluster.servers.len() as u64 != replicas {
        fail(format!(
            "cluster.servers lists {} servers, the StatefulSet runs {replicas} replicas",
            cfg.cluster.servers.len()
        ));
    }
    let container_ports: Vec<(u64, &str, &str)> = seq_at(server, "ports")
        .iter()
        .map(|p| {
            (
                get(p, "containerPort").as_u64().unwrap_or(0),
                str_at(p, "name"),
                str_at(p, "protocol"),
            )
        })
        .collect();
    let service_ports: Vec<(u64, &Value, &str)> = find(objects, "Service", service_name)
        .map(|svc| {
            seq_at(svc, "spec.ports")
                .iter()
                .map(|p| {
                    let target = p.get("targetPort").unwrap_or(get(p, "port"));
                    (
                        get(p, "port").as_u64().unwrap_or(0),
                        target,
                        str_at(p, "protocol"),
                    )
                })
                .collect()
        })
        .unwrap_or_default();
    let listen = flag(&argv(server), "--listen");
    for (i, entry) in cfg.cluster.servers.iter().enumerate() {
        let Some((host, port)) = entry.rsplit_once(':') else {
            fail(format!("cluster.servers[{i}] `{entry}` has no port"));
            continue;
        };
        let pod = format!("{SERVER_SET}-{i}.{service_name}");
        let names = [
            pod.clone(),
            format!("{pod}.{ns}"),
            format!("{pod}.{ns}.svc"),
            format!("{pod}.{ns}.svc.cluster.local"),
        ];
        if !names.iter().any(|n| n == host) {
            fail(format!(
                "cluster.servers[{i}] `{entry}` is not the DNS name of pod {SERVER_SET}-{i} ({pod})"
            ));
        }
        let port: u64 = port.parse().unwrap_or(0);
        if !container_ports
            .iter()
            .any(|(p, _, proto)| *p == port && *proto == "UDP")
        {
            fail(format!(
                "cluster.servers[{i}]: the ps-server container exposes no UDP port {port}"
            ));
        }
        let exposed = service_ports.iter().any(|(p, target, proto)| {
            let reaches = match target {
                Value::Number(n) => n.as_u64() == Some(port),
                Value::String(s) => container_ports
                    .iter()
                    .any(|(cp, n, _)| *n == s.as_str() && *cp == port),
                _ => false,
            };
            *p == port && *proto == "UDP" && reaches
        });
        if !exposed {
            fail(format!(
                "cluster.servers[{i}]: Service {service_name} has no UDP port {port} to the container's"
            ));
        }
        if listen.is_some_and(|l| !l.ends_with(&format!(":{port}"))) {
            fail(format!(
                "ps-server listens on {}, cluster.servers[{i}] says port {port}",
                listen.unwrap_or("")
            ));
        }
    }
    let index_from_pod = env(server, "STRATUS_SERVER_INDEX")
        .is_some_and(|e| str_at(e, "valueFrom.fieldRef.fieldPath") == POD_INDEX_LABEL);
    if !index_from_pod {
        fail(format!(
            "ps-server must take STRATUS_SERVER_INDEX from its pod ({POD_INDEX_LABEL})"
        ));
    }

    // Workers: one Job index per rank, all at once.
    let workers = cfg.cluster.workers as u64;
    if str_at(job, "spec.completionMode") != "Indexed" {
        fail(format!("Job {WORKER_JOB}: completionMode must be Indexed"));
    }
    for field in ["completions", "parallelism"] {
        let n = get(job, &format!("spec.{field}")).as_u64();
        if n != Some(workers) {
            fail(format!(
                "Job {WORKER_JOB}: {field} is {n:?}, cluster.workers is {workers}"
            ));
        }
    }
    let index_var = "$(JOB_COMPLETION_INDEX)";
    let rank_from_index = flag(&argv(worker), "--rank") == Some(index_var)
        || env(worker, "STRATUS_RANK").is_some_and(|e| {
            str_at(e, "value") == index_var
                || str_at(e, "valueFrom.fieldRef.fieldPath") == INDEX_ANNOTATION
        });
    if !rank_from_index {
        fail("ps-worker must take its rank from JOB_COMPLETION_INDEX".into());
    }
    if let Some(e) = env(worker, "JOB_COMPLETION_INDEX") {
        if str_at(e, "valueFrom.fieldRef.fieldPath") != INDEX_ANNOTATION {
            fail(format!(
                "JOB_COMPLETION_INDEX must come from {INDEX_ANNOTATION}"
            ));
        }
    }
    let per_index = get(job, "spec.backoffLimitPerIndex").is_number()
        || get(job, "spec.podFailurePolicy").is_mapping();
    if per_index && str_at(pod_spec(job), "restartPolicy") != "Never" {
        fail(format!(
            "Job {WORKER_JOB}: backoffLimitPerIndex and podFailurePolicy need restartPolicy Never"
        ));
    }

    // Every Secret and ConfigMap referred to exists, or the user makes it.
    for o in objects {
        for (k, n) in references(o) {
            let defined = find(objects, k, &n).is_some();
            let user_made = k == "Secret" && ctx.user_secrets.contains(&format!("`{n}`"));
            if !(defined || user_made) {
                fail(format!(
                    "{} {} refers to {k} {n}, which is neither defined nor in the list `{USER_SECRETS_HEADING}` of docs/deploy.md",
                    kind(o),
                    name(o)
                ));
            }
        }
    }

    // Images: the one the repository builds.
    for o in objects {
        for c in seq_at(pod_spec(o), "containers")
            .iter()
            .chain(seq_at(pod_spec(o), "initContainers"))
        {
            let image = str_at(c, "image");
            if image_repo(image) != ctx.image {
                fail(format!(
                    "{} {}: image `{image}` is not {} (docker-compose.yml, Dockerfile)",
                    kind(o),
                    name(o),
                    ctx.image
                ));
            }
        }
    }

    // The disruption budget covers the servers only.
    let pdbs: Vec<&Value> = objects
        .iter()
        .filter(|o| kind(o) == "PodDisruptionBudget")
        .collect();
    let set_labels = get(set, "spec.template.metadata.labels");
    let job_labels = get(job, "spec.template.metadata.labels");
    let covering = pdbs
        .iter()
        .filter(|p| selects(get(p, "spec.selector.matchLabels"), set_labels))
        .count();
    if covering == 0 {
        fail(format!(
            "no PodDisruptionBudget selects the pods of StatefulSet {SERVER_SET}"
        ));
    }
    for p in &pdbs {
        if selects(get(p, "spec.selector.matchLabels"), job_labels) {
            fail(format!(
                "PodDisruptionBudget {} selects worker pods",
                name(p)
            ));
        }
    }
    if !selects(get(set, "spec.selector.matchLabels"), set_labels) {
        fail(format!(
            "StatefulSet {SERVER_SET}: its selector misses its own pods"
        ));
    }
    problems
}

/// The GPU the worker container asks for (0 when none).
fn worker_gpus(objects: &[Value]) -> u64 {
    find(objects, "Job", WORKER_JOB)
        .and_then(|j| container(j, "ps-worker"))
        .and_then(|c| get(c, "resources.limits").get(GPU))
        .and_then(Value::as_u64)
        .unwrap_or(0)
}

/// The cluster.toml of a ConfigMap.
fn cm_text(cm: &Value) -> String {
    get(cm, "data")
        .get("cluster.toml")
        .and_then(Value::as_str)
        .unwrap_or("")
        .to_string()
}

fn built(dir: &str) -> Vec<Value> {
    build(&deploy().join(dir)).unwrap_or_else(|e| panic!("building {dir}: {e}"))
}

fn assert_clean(objects: &[Value], what: &str) {
    let problems = check(objects, &Context::load());
    assert!(problems.is_empty(), "{what}:\n  {}", problems.join("\n  "));
}

fn assert_reports(objects: &[Value], needle: &str) {
    let problems = check(objects, &Context::load());
    assert!(
        problems.iter().any(|p| p.contains(needle)),
        "expected a problem mentioning `{needle}`, got {problems:#?}"
    );
}

// ----------------------------------------------------------------- tests

#[test]
fn every_yaml_file_parses_and_names_its_objects() {
    let mut files = Vec::new();
    yaml_files(&deploy(), &mut files);
    assert!(files.len() >= 8, "too few YAML files: {files:?}");
    for file in &files {
        let docs = parse_docs(&read(file), &file.display().to_string()).unwrap();
        assert!(!docs.is_empty(), "{} holds no document", file.display());
        for doc in &docs {
            assert!(
                !str_at(doc, "apiVersion").is_empty() && !kind(doc).is_empty(),
                "{}: a document without apiVersion or kind",
                file.display()
            );
            if kind(doc) != "Kustomization" {
                assert!(
                    !name(doc).is_empty(),
                    "{}: a {} without metadata.name",
                    file.display(),
                    kind(doc)
                );
            }
        }
    }
}

#[test]
fn default_deployment_is_consistent() {
    let objects = built("");
    assert_clean(&objects, "deploy/kubernetes");
    assert_eq!(
        worker_gpus(&objects),
        0,
        "the default deployment asks for no GPU"
    );
    let set = find(&objects, "StatefulSet", SERVER_SET).unwrap();
    assert_eq!(str_at(set, "metadata.namespace"), "stratus");
    let kinds: BTreeSet<&str> = objects.iter().map(kind).collect();
    for k in [
        "Namespace",
        "ConfigMap",
        "Service",
        "StatefulSet",
        "PodDisruptionBudget",
        "Job",
    ] {
        assert!(kinds.contains(k), "no {k} in {kinds:?}");
    }
}

#[test]
fn gpu_overlay_gives_each_worker_a_gpu() {
    let objects = built("overlays/gpu");
    assert_clean(&objects, "overlays/gpu");
    assert_eq!(worker_gpus(&objects), 1);
    let worker = container(find(&objects, "Job", WORKER_JOB).unwrap(), "ps-worker").unwrap();
    let device = env(worker, "STRATUS_DEVICE").map(|e| str_at(e, "value"));
    assert!(
        device.is_some_and(|d| d.starts_with("cuda")),
        "device {device:?}"
    );
    let server = container(
        find(&objects, "StatefulSet", SERVER_SET).unwrap(),
        "ps-server",
    )
    .unwrap();
    assert!(
        get(server, "resources.limits").get(GPU).is_none(),
        "servers need no GPU"
    );
}

#[test]
fn scale_overlay_changes_config_and_workloads_together() {
    let objects = built("overlays/scale");
    assert_clean(&objects, "overlays/scale");
    let job = find(&objects, "Job", WORKER_JOB).unwrap();
    let cfg = cluster_config(&objects, job, container(job, "ps-worker").unwrap()).unwrap();
    assert_eq!(cfg.cluster.workers, 4);
    assert_eq!(cfg.cluster.servers.len(), 3);
    let base = built("");
    let job = find(&base, "Job", WORKER_JOB).unwrap();
    let base_cfg = cluster_config(&base, job, container(job, "ps-worker").unwrap()).unwrap();
    // Only the topology differs from the base config.
    let mut same = cfg.clone();
    same.cluster.workers = base_cfg.cluster.workers;
    same.cluster.servers = base_cfg.cluster.servers.clone();
    assert_eq!(
        same, base_cfg,
        "overlays/scale/cluster.toml drifted from base/cluster.toml"
    );
}

/// kustomize's own build (hashed ConfigMap names and all) passes the same
/// checks, when `kubectl` is installed.
#[test]
fn kubectl_kustomize_build_passes_too() {
    for dir in ["", "overlays/gpu", "overlays/scale"] {
        let out = match std::process::Command::new("kubectl")
            .arg("kustomize")
            .arg(deploy().join(dir))
            .output()
        {
            Ok(out) => out,
            Err(_) => {
                eprintln!("kubectl is not installed; skipping the kustomize build");
                return;
            }
        };
        assert!(
            out.status.success(),
            "kubectl kustomize {dir}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let objects =
            parse_docs(&String::from_utf8_lossy(&out.stdout), "kubectl kustomize").unwrap();
        assert_clean(
            &objects,
            &format!("kubectl kustomize deploy/kubernetes/{dir}"),
        );
        let ours: BTreeSet<(String, String)> = built(dir)
            .iter()
            .map(|o| (kind(o).to_string(), name(o).to_string()))
            .collect();
        for o in &objects {
            let n = name(o);
            let plain = match kind(o) {
                "ConfigMap" => n.rsplit_once('-').map_or(n, |(stem, _)| stem),
                _ => n,
            };
            assert!(
                ours.contains(&(kind(o).to_string(), plain.to_string())),
                "{dir}: kubectl builds {} {n}, the resolver does not",
                kind(o)
            );
        }
        assert_eq!(ours.len(), objects.len(), "{dir}: object counts differ");
        assert_eq!(
            worker_gpus(&objects),
            worker_gpus(&built(dir)),
            "{dir}: GPUs differ"
        );
    }
}

// The checks fail when the manifests disagree.

#[test]
fn worker_count_mismatch_is_reported() {
    let mut objects = built("");
    *child(
        child(find_mut(&mut objects, "Job", WORKER_JOB), "spec"),
        "completions",
    ) = yaml("3");
    assert_reports(&objects, "completions is Some(3), cluster.workers is 2");
    let mut objects = built("");
    *child(
        child(find_mut(&mut objects, "Job", WORKER_JOB), "spec"),
        "completionMode",
    ) = Value::from("NonIndexed");
    assert_reports(&objects, "completionMode must be Indexed");
}

#[test]
fn server_list_mismatch_is_reported() {
    let mut objects = built("");
    *child(
        child(find_mut(&mut objects, "StatefulSet", SERVER_SET), "spec"),
        "replicas",
    ) = yaml("3");
    assert_reports(&objects, "the StatefulSet runs 3 replicas");

    let mut objects = built("");
    let cm = find_mut(&mut objects, "ConfigMap", "stratus-config");
    let text = cm_text(cm);
    assert!(!text.is_empty());
    let moved = text.replace("ps-server-1.ps-server:7400", "ps-server-1.ps-server:7401");
    assert_ne!(moved, text);
    *child(child(cm, "data"), "cluster.toml") = Value::from(moved);
    assert_reports(&objects, "exposes no UDP port 7401");
    assert_reports(&objects, "Service ps-server has no UDP port 7401");

    let mut objects = built("");
    let cm = find_mut(&mut objects, "ConfigMap", "stratus-config");
    let text = cm_text(cm).replace("ps-server-1.ps-server:", "ps-1.example:");
    *child(child(cm, "data"), "cluster.toml") = Value::from(text);
    assert_reports(&objects, "is not the DNS name of pod ps-server-1");
}

#[test]
fn broken_config_rank_and_references_are_reported() {
    let mut objects = built("");
    let cm = find_mut(&mut objects, "ConfigMap", "stratus-config");
    let text = cm_text(cm).replace("workers = 2", "workers = 0");
    *child(child(cm, "data"), "cluster.toml") = Value::from(text);
    assert_reports(&objects, "cluster.workers");

    let mut objects = built("");
    let worker = containers_mut(find_mut(&mut objects, "Job", WORKER_JOB))
        .into_iter()
        .next()
        .unwrap();
    *child(worker, "command") = yaml("[ps-worker, train, --rank, '0']");
    assert_reports(&objects, "rank from JOB_COMPLETION_INDEX");

    let mut objects = built("");
    let worker = containers_mut(find_mut(&mut objects, "Job", WORKER_JOB))
        .into_iter()
        .next()
        .unwrap();
    merge(
        child(worker, "envFrom"),
        &yaml("[{secretRef: {name: not-in-the-readme}}]"),
    );
    assert_reports(&objects, "refers to Secret not-in-the-readme");

    let mut objects = built("");
    let server = containers_mut(find_mut(&mut objects, "StatefulSet", SERVER_SET))
        .into_iter()
        .next()
        .unwrap();
    *child(server, "image") = Value::from("elsewhere/stratus:latest");
    assert_reports(&objects, "image `elsewhere/stratus:latest`");
}

#[test]
fn pdb_that_misses_the_servers_is_reported() {
    let mut objects = built("");
    let pdb = objects
        .iter_mut()
        .find(|o| kind(o) == "PodDisruptionBudget")
        .unwrap();
    let labels = child(child(child(pdb, "spec"), "selector"), "matchLabels");
    *child(labels, "app.kubernetes.io/component") = Value::from("ps-worker");
    assert_reports(&objects, "no PodDisruptionBudget selects the pods");
    assert_reports(&objects, "selects worker pods");
}

#[test]
fn resolver_merges_named_lists_and_sets_images() {
    let mut base = yaml(
        "{spec: {template: {spec: {containers: [{name: a, image: 'stratus:latest', env: [{name: X, value: '1'}]}]}}}}",
    );
    let patch = yaml(
        "{spec: {template: {spec: {containers: [{name: a, env: [{name: Y, value: '2'}], resources: {limits: {nvidia.com/gpu: 1}}}]}}}}",
    );
    merge(&mut base, &patch);
    let c = &seq_at(&base, "spec.template.spec.containers")[0];
    assert_eq!(str_at(c, "image"), "stratus:latest");
    assert_eq!(seq_at(c, "env").len(), 2);
    assert_eq!(
        get(c, "resources.limits").get(GPU).and_then(Value::as_u64),
        Some(1)
    );
    assert_eq!(
        image_repo("registry:5000/team/stratus:cuda"),
        "registry:5000/team/stratus"
    );
    assert_eq!(image_repo("registry:5000/stratus"), "registry:5000/stratus");
    assert_eq!(image_repo("stratus@sha256:abc"), "stratus");
}

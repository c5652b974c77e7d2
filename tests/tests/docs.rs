//! The README and the pages of docs/ hold true for the repository:
//!
//! * every relative link resolves: the file or folder exists, and an anchor
//!   (`page.md#some-heading`) names a heading of that page;
//! * every command block marked as cheap runs and exits 0.
//!
//! A block is marked by its info string, ```` ```sh test ````. It runs
//! with `bash -euo pipefail` in a fresh temporary directory that holds a
//! link to the repository's `configs/` (so `--config configs/x.toml` works
//! as from the repository root), with the `ps-server` and `ps-worker`
//! binaries of this build first on `PATH`. Blocks that need a cluster, the
//! network, torch or minutes stay unmarked (```` ```sh ````).

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::Duration;

/// The info string of a block the test runs.
const MARK: &str = "sh test";
/// Longest a marked block may run before the test calls it hung.
const BLOCK_DEADLINE: Duration = Duration::from_secs(120);

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .canonicalize()
        .expect("the repository root")
}

/// README.md and docs/*.md.
fn pages() -> Vec<PathBuf> {
    let root = repo();
    let mut pages = vec![root.join("README.md")];
    let docs = root.join("docs");
    for entry in std::fs::read_dir(&docs).unwrap_or_else(|e| panic!("{}: {e}", docs.display())) {
        let path = entry.expect("a directory entry").path();
        if path.extension().is_some_and(|e| e == "md") {
            pages.push(path);
        }
    }
    pages.sort();
    pages
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// One line of a page, with whether it is inside a fenced code block (the
/// fence lines themselves count as inside).
fn lines_with_fences(text: &str) -> impl Iterator<Item = (usize, &str, bool)> {
    let mut fenced = false;
    text.lines().enumerate().map(move |(i, line)| {
        let fence = line.trim_start().starts_with("```");
        if fence {
            fenced = !fenced;
        }
        (i + 1, line, fenced || fence)
    })
}

/// The anchor a heading gets: lower case, punctuation dropped, spaces as
/// hyphens; a repeated heading gets `-1`, `-2`, ... appended.
fn slug(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
            _ => None,
        })
        .collect()
}

fn anchors(text: &str) -> Vec<String> {
    let mut seen: HashMap<String, usize> = HashMap::new();
    let mut out = Vec::new();
    for (_, line, fenced) in lines_with_fences(text) {
        let hashes = line.chars().take_while(|&c| c == '#').count();
        if fenced || hashes == 0 || hashes > 6 || !line[hashes..].starts_with(' ') {
            continue;
        }
        let base = slug(line[hashes..].trim_end_matches('#'));
        let n = seen.entry(base.clone()).or_insert(0);
        out.push(if *n == 0 { base } else { format!("{base}-{n}") });
        *n += 1;
    }
    out
}

/// Link targets outside code (fenced blocks and inline code spans), with
/// their line numbers.
fn links(text: &str) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    for (n, line, fenced) in lines_with_fences(text) {
        if fenced {
            continue;
        }
        // Text between backticks is code: keep the even segments only.
        let prose: String = line.split('`').step_by(2).collect::<Vec<_>>().join(" ");
        for (i, _) in prose.match_indices("](") {
            let rest = &prose[i + 2..];
            if let Some(end) = rest.find(')') {
                // `[text](target "title")`: the target is the first word.
                let target = rest[..end].split_whitespace().next().unwrap_or("");
                out.push((n, target.to_string()));
            }
        }
    }
    out
}

#[test]
fn every_relative_link_resolves() {
    let mut page_anchors: BTreeMap<PathBuf, Vec<String>> = BTreeMap::new();
    let mut anchors_of = |path: &Path| {
        page_anchors
            .entry(path.to_path_buf())
            .or_insert_with(|| anchors(&read(path)))
            .clone()
    };
    let mut broken = Vec::new();
    let mut checked = 0;
    for page in pages() {
        let text = read(&page);
        for (line, target) in links(&text) {
            if target.contains("://") || target.starts_with("mailto:") {
                continue;
            }
            checked += 1;
            let (file, anchor) = target.split_once('#').unwrap_or((&target, ""));
            let resolved = if file.is_empty() {
                page.clone()
            } else {
                page.parent().expect("a page's folder").join(file)
            };
            let at = format!("{}:{line}: `{target}`", page.display());
            if !resolved.exists() {
                broken.push(format!("{at}: {} does not exist", resolved.display()));
                continue;
            }
            let is_page = resolved.extension().is_some_and(|e| e == "md");
            if !anchor.is_empty() && is_page && !anchors_of(&resolved).iter().any(|a| a == anchor) {
                broken.push(format!(
                    "{at}: {} has no heading with the anchor #{anchor}",
                    resolved.display()
                ));
            }
        }
    }
    assert!(checked >= 20, "only {checked} relative links found");
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
}

/// A marked command block: where it is and what it runs.
struct Block {
    at: String,
    script: String,
}

fn marked_blocks(page: &Path, text: &str) -> Vec<Block> {
    let mut blocks = Vec::new();
    let mut current: Option<Block> = None;
    let mut fenced = false;
    for (i, line) in text.lines().enumerate() {
        let trimmed = line.trim_start();
        if let Some(info) = trimmed.strip_prefix("```") {
            if fenced {
                blocks.extend(current.take());
            } else if info.trim() == MARK {
                current = Some(Block {
                    at: format!("{}:{}", page.display(), i + 1),
                    script: String::new(),
                });
            }
            fenced = !fenced;
        } else if let Some(block) = current.as_mut() {
            block.script.push_str(line);
            block.script.push('\n');
        }
    }
    blocks
}

/// Waits for `child` to end, for at most `limit`; past that kills it and
/// returns `None`. The wait is an event: a thread blocks in `wait` and
/// reports the exit, and the deadline is a bound on the receive.
fn wait_at_most(mut child: Child, limit: Duration) -> Result<Option<ExitStatus>, String> {
    let pid = child.id();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait());
    });
    let waited = match rx.recv_timeout(limit) {
        Ok(waited) => {
            return waited
                .map(Some)
                .map_err(|e| format!("waiting for bash: {e}"))
        }
        Err(mpsc::RecvTimeoutError::Disconnected) => return Err("the waiting thread died".into()),
        Err(mpsc::RecvTimeoutError::Timeout) => {
            // The pid is the child's until the thread's `wait` reaps it; a
            // child that ended in the instant since cannot have passed the
            // pid on yet (Linux hands out pids in sequence, wrapping only
            // after pid_max others).
            let _ = Command::new("bash")
                .args(["-c", &format!("kill -KILL {pid}")])
                .stderr(Stdio::null())
                .status();
            rx.recv()
        }
    };
    waited
        .map_err(|_| "the waiting thread died".to_string())?
        .map_err(|e| format!("waiting for bash: {e}"))?;
    Ok(None)
}

/// Runs `block` in `dir`; the failure message, if any.
fn run_block(block: &Block, dir: &Path, path: &str) -> Result<(), String> {
    let out = dir.join(".stdout");
    let err = dir.join(".stderr");
    let file = |p: &Path| std::fs::File::create(p).expect("an output file in the temporary folder");
    let child = Command::new("bash")
        .args(["-euo", "pipefail", "-c", &block.script])
        .current_dir(dir)
        .env("PATH", path)
        .env_remove("STRATUS_CONFIG")
        .env_remove("STRATUS_TOKEN")
        .env_remove("STRATUS_RANK")
        .env_remove("STRATUS_NODE")
        .env_remove("STRATUS_SERVER_INDEX")
        .env_remove("STRATUS_DEVICE")
        .stdin(Stdio::null())
        .stdout(file(&out))
        .stderr(file(&err))
        .spawn()
        .map_err(|e| format!("bash: {e}"))?;
    let status = wait_at_most(child, BLOCK_DEADLINE)?;
    let output = format!(
        "--- stdout\n{}--- stderr\n{}",
        std::fs::read_to_string(&out).unwrap_or_default(),
        std::fs::read_to_string(&err).unwrap_or_default()
    );
    match status {
        Some(s) if s.success() => Ok(()),
        Some(s) => Err(format!(
            "{}: exited with {s}\n{}\n{output}",
            block.at, block.script
        )),
        None => Err(format!(
            "{}: still running after {BLOCK_DEADLINE:?}\n{}\n{output}",
            block.at, block.script
        )),
    }
}

#[test]
fn marked_command_blocks_run() {
    let bin_dir = ps_tests::profile_binary("ps-worker")
        .parent()
        .expect("the profile folder")
        .to_path_buf();
    for other in ["ps-server", "ps-data"] {
        assert_eq!(
            ps_tests::profile_binary(other).parent(),
            Some(bin_dir.as_path())
        );
    }
    let path = format!(
        "{}:{}",
        bin_dir.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let root = repo();
    let blocks: Vec<Block> = pages()
        .iter()
        .flat_map(|page| marked_blocks(page, &read(page)))
        .collect();
    assert!(
        blocks.len() >= 6,
        "only {} blocks marked `{MARK}`",
        blocks.len()
    );
    let mut failures = Vec::new();
    for block in &blocks {
        let dir = tempfile::tempdir().expect("a temporary folder");
        std::os::unix::fs::symlink(root.join("configs"), dir.path().join("configs"))
            .expect("link configs/ into the temporary folder");
        if let Err(e) = run_block(block, dir.path(), &path) {
            failures.push(e);
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

#[test]
fn the_parsers_see_what_a_reader_sees() {
    let page = "# Top\n\n## A `code` heading, with: punctuation\n\n```sh test\n# not a heading\necho [x](nowhere.md)\n```\n\nSee [here](#top) and `[not](a-link.md)`.\n\n## Top\n";
    assert_eq!(
        anchors(page),
        ["top", "a-code-heading-with-punctuation", "top-1"]
    );
    assert_eq!(links(page), [(10, "#top".to_string())]);
    let blocks = marked_blocks(Path::new("p.md"), page);
    assert_eq!(blocks.len(), 1);
    assert_eq!(blocks[0].at, "p.md:5");
    assert_eq!(blocks[0].script, "# not a heading\necho [x](nowhere.md)\n");
}

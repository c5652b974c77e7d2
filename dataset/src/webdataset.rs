//! WebDataset tar shards: brace-expanded shard names, a streaming tar
//! scanner that finds every member's byte range in one pass, grouping of
//! members into samples by key, and a shard writer.
//!
//! A WebDataset sample is the set of members sharing a key: the member path
//! up to the first `.` of its file name (`train/0001/cat.jpg` and
//! `train/0001/cat.cls` make sample `train/0001/cat`). Stratus reads the
//! image (`.jpg`, `.jpeg`, `.png`) with one range GET and takes the label
//! from `.cls` (a decimal integer) or `.json` (a number, or an object with a
//! `label` or `cls` field), read once while indexing.

use bytes::Bytes;

/// Expands `{a..b}` numeric ranges (zero-padded to the width of `a`) and
/// `{x,y,z}` lists, left to right: `train-{000..002}.tar` gives three names.
pub fn expand_braces(pattern: &str) -> Result<Vec<String>, String> {
    let Some(open) = pattern.find('{') else {
        if pattern.contains('}') {
            return Err(format!("`{pattern}` has a `}}` without a `{{`"));
        }
        return Ok(vec![pattern.to_string()]);
    };
    let close = pattern[open..]
        .find('}')
        .map(|c| open + c)
        .ok_or_else(|| format!("`{pattern}` has a `{{` without a `}}`"))?;
    let (head, body, tail) = (
        &pattern[..open],
        &pattern[open + 1..close],
        &pattern[close + 1..],
    );
    let choices: Vec<String> = if let Some((a, b)) = body.split_once("..") {
        let parse = |s: &str| {
            s.parse::<u64>()
                .map_err(|_| format!("`{{{body}}}` in `{pattern}` is not a range of numbers"))
        };
        let (lo, hi) = (parse(a)?, parse(b)?);
        if lo > hi {
            return Err(format!("`{{{body}}}` in `{pattern}` counts down"));
        }
        if hi - lo >= 1_000_000 {
            return Err(format!(
                "`{{{body}}}` in `{pattern}` names over a million shards"
            ));
        }
        let width = a.len();
        (lo..=hi).map(|v| format!("{v:0width$}")).collect()
    } else {
        body.split(',').map(str::to_string).collect()
    };
    let rest = expand_braces(tail)?;
    let mut out = Vec::with_capacity(choices.len() * rest.len());
    for c in &choices {
        for r in &rest {
            out.push(format!("{head}{c}{r}"));
        }
    }
    Ok(out)
}

/// A member of a tar archive: where its data lies.
#[derive(Debug, Clone, PartialEq)]
pub struct TarMember {
    pub name: String,
    /// Byte offset of the member's data in the archive.
    pub offset: u64,
    pub len: u64,
    /// The data, for members the scanner was asked to keep (small labels).
    pub data: Option<Bytes>,
    /// CRC-32 of the member's data, computed as it streams past.
    pub crc32: u32,
}

const BLOCK: usize = 512;
/// Label members larger than this are not kept in memory while indexing.
pub const MAX_KEPT_MEMBER: u64 = 64 * 1024;

enum State {
    /// Collecting the next 512-byte header.
    Header,
    /// Passing over `remaining` bytes of padding or extended headers.
    Skip { remaining: u64 },
    /// Passing over a member's data, not kept but checksummed, then `pad`
    /// bytes of padding.
    Hash {
        member: TarMember,
        hasher: crc32fast::Hasher,
        remaining: u64,
        pad: u64,
    },
    /// Collecting a member's data, then `pad` bytes of padding.
    Collect {
        kind: Collecting,
        remaining: u64,
        pad: u64,
    },
    /// Two zero blocks (or one) ended the archive.
    End,
}

enum Collecting {
    /// A GNU long name for the next member.
    LongName,
    /// A pax extended header for the next member.
    Pax,
    /// A kept regular member.
    Member(TarMember),
}

/// Finds the members of a tar archive fed to it in chunks of any size, so
/// that a shard is indexed while it streams past, holding only headers and
/// the members `keep` selects.
pub struct TarScanner<F: Fn(&str) -> bool> {
    keep: F,
    state: State,
    pos: u64,
    buf: Vec<u8>,
    next_name: Option<String>,
    /// The current member's name and start, for error messages.
    current: Option<(String, u64)>,
    members: Vec<TarMember>,
}

impl<F: Fn(&str) -> bool> TarScanner<F> {
    /// `keep` names the regular members whose data is collected.
    pub fn new(keep: F) -> Self {
        Self {
            keep,
            state: State::Header,
            pos: 0,
            buf: Vec::new(),
            next_name: None,
            current: None,
            members: Vec::new(),
        }
    }

    /// Feeds the next bytes of the archive.
    pub fn feed(&mut self, mut chunk: &[u8]) -> Result<(), String> {
        while !chunk.is_empty() {
            match &mut self.state {
                State::End => return Ok(()),
                State::Header => {
                    let take = (BLOCK - self.buf.len()).min(chunk.len());
                    self.buf.extend_from_slice(&chunk[..take]);
                    chunk = &chunk[take..];
                    self.pos += take as u64;
                    if self.buf.len() == BLOCK {
                        let block = std::mem::take(&mut self.buf);
                        self.header(&block)?;
                    }
                }
                State::Skip { remaining } => {
                    let take = (*remaining).min(chunk.len() as u64);
                    *remaining -= take;
                    chunk = &chunk[take as usize..];
                    self.pos += take;
                    if *remaining == 0 {
                        self.state = State::Header;
                    }
                }
                State::Hash {
                    hasher, remaining, ..
                } => {
                    let take = (*remaining).min(chunk.len() as u64) as usize;
                    hasher.update(&chunk[..take]);
                    chunk = &chunk[take..];
                    self.pos += take as u64;
                    *remaining -= take as u64;
                    if *remaining == 0 {
                        if let State::Hash {
                            mut member,
                            hasher,
                            pad,
                            ..
                        } = std::mem::replace(&mut self.state, State::Header)
                        {
                            member.crc32 = hasher.finalize();
                            self.members.push(member);
                            if pad > 0 {
                                self.state = State::Skip { remaining: pad };
                            }
                        }
                    }
                }
                State::Collect {
                    kind,
                    remaining,
                    pad,
                } => {
                    let take = (*remaining).min(chunk.len() as u64) as usize;
                    self.buf.extend_from_slice(&chunk[..take]);
                    chunk = &chunk[take..];
                    self.pos += take as u64;
                    *remaining -= take as u64;
                    if *remaining == 0 {
                        let data = std::mem::take(&mut self.buf);
                        let pad = *pad;
                        let kind = std::mem::replace(kind, Collecting::LongName);
                        self.state = if pad == 0 {
                            State::Header
                        } else {
                            State::Skip { remaining: pad }
                        };
                        self.collected(kind, data)?;
                    }
                }
            }
        }
        Ok(())
    }

    /// Ends the archive: the members found, or an error when it stopped in
    /// the middle of a member.
    pub fn finish(self) -> Result<Vec<TarMember>, String> {
        // Every tar writer ends an archive with zero blocks; an archive
        // without them was cut short, even when the cut falls between members.
        if matches!(self.state, State::Header) && self.buf.is_empty() {
            return Err(format!(
                "the archive is truncated: it ends at byte {} without the end-of-archive blocks",
                self.pos
            ));
        }
        if !matches!(self.state, State::End) {
            let (name, start) = self.current.clone().unwrap_or_default();
            return Err(format!(
                "the archive is truncated: it ends at byte {} inside member `{name}` (which starts at byte {start})",
                self.pos
            ));
        }
        Ok(self.members)
    }

    fn header(&mut self, block: &[u8]) -> Result<(), String> {
        let at = self.pos - BLOCK as u64;
        if block.iter().all(|&b| b == 0) {
            if self.next_name.is_some() {
                return Err(format!(
                    "a long-name record at byte {at} is not followed by a member"
                ));
            }
            self.state = State::End;
            return Ok(());
        }
        let stored = octal(&block[148..156]).ok_or_else(|| {
            format!("the header at byte {at} has a bad checksum field: not a tar archive?")
        })?;
        let sum: u64 = block
            .iter()
            .enumerate()
            .map(|(i, &b)| {
                if (148..156).contains(&i) {
                    32
                } else {
                    u64::from(b)
                }
            })
            .sum();
        if sum != stored {
            return Err(format!(
                "the header at byte {at} fails its checksum ({sum} != {stored}): not a tar archive, or damaged"
            ));
        }
        let size = size_field(&block[124..136])
            .ok_or_else(|| format!("the header at byte {at} has a bad size field"))?;
        let pad = (BLOCK as u64 - size % BLOCK as u64) % BLOCK as u64;
        let header_name = || {
            let name = cstr(&block[..100]);
            if &block[257..262] == b"ustar" {
                let prefix = cstr(&block[345..500]);
                if !prefix.is_empty() {
                    return format!("{prefix}/{name}");
                }
            }
            name
        };
        let kind = match block[156] {
            b'L' => Some(Collecting::LongName),
            b'x' => Some(Collecting::Pax),
            b'0' | 0 | b'7' => {
                let name = self.next_name.take().unwrap_or_else(header_name);
                self.current = Some((name.clone(), at));
                let member = TarMember {
                    name,
                    offset: self.pos,
                    len: size,
                    data: None,
                    crc32: crc32fast::hash(&[]),
                };
                if (self.keep)(&member.name) && size <= MAX_KEPT_MEMBER {
                    Some(Collecting::Member(member))
                } else if size == 0 {
                    self.members.push(member);
                    None
                } else {
                    self.state = State::Hash {
                        member,
                        hasher: crc32fast::Hasher::new(),
                        remaining: size,
                        pad,
                    };
                    return Ok(());
                }
            }
            _ => {
                // Directories, links, global pax headers: nothing to index.
                self.next_name = None;
                self.current = Some((header_name(), at));
                None
            }
        };
        if matches!(kind, Some(Collecting::LongName | Collecting::Pax)) && size > MAX_KEPT_MEMBER {
            return Err(format!(
                "the extended header at byte {at} is {size} bytes long"
            ));
        }
        self.state = match kind {
            Some(kind) if size > 0 => State::Collect {
                kind,
                remaining: size,
                pad,
            },
            Some(kind) => {
                self.collected(kind, Vec::new())?;
                State::Header
            }
            None if size + pad > 0 => State::Skip {
                remaining: size + pad,
            },
            None => State::Header,
        };
        Ok(())
    }

    fn collected(&mut self, kind: Collecting, data: Vec<u8>) -> Result<(), String> {
        match kind {
            Collecting::LongName => self.next_name = Some(cstr(&data)),
            Collecting::Pax => {
                if let Some(path) = pax_path(&data) {
                    self.next_name = Some(path);
                }
            }
            Collecting::Member(mut m) => {
                m.crc32 = crc32fast::hash(&data);
                m.data = Some(Bytes::from(data));
                self.members.push(m);
            }
        }
        Ok(())
    }
}

fn cstr(field: &[u8]) -> String {
    let end = field.iter().position(|&b| b == 0).unwrap_or(field.len());
    String::from_utf8_lossy(&field[..end]).into_owned()
}

fn octal(field: &[u8]) -> Option<u64> {
    let text = std::str::from_utf8(field).ok()?;
    let text = text.trim_matches(|c: char| c == '\0' || c == ' ');
    if text.is_empty() {
        return Some(0);
    }
    u64::from_str_radix(text, 8).ok()
}

/// The size field: octal, or big-endian base-256 when the top bit is set.
fn size_field(field: &[u8]) -> Option<u64> {
    if field[0] & 0x80 != 0 {
        let mut v: u64 = u64::from(field[0] & 0x7f);
        for &b in &field[1..] {
            v = v.checked_mul(256)?.checked_add(u64::from(b))?;
        }
        return Some(v);
    }
    octal(field)
}

/// The `path` record of a pax extended header (`"<len> path=<value>\n"`).
fn pax_path(data: &[u8]) -> Option<String> {
    let mut rest = data;
    while !rest.is_empty() {
        let space = rest.iter().position(|&b| b == b' ')?;
        let len: usize = std::str::from_utf8(&rest[..space]).ok()?.parse().ok()?;
        if len <= space || len > rest.len() {
            return None;
        }
        let record = &rest[space + 1..len];
        let record = record.strip_suffix(b"\n").unwrap_or(record);
        if let Some(v) = record.strip_prefix(b"path=") {
            return Some(String::from_utf8_lossy(v).into_owned());
        }
        rest = &rest[len..];
    }
    None
}

/// The WebDataset key and extension of a member name: `a/b.c.jpg` gives
/// (`a/b`, `c.jpg`).
pub fn split_key(name: &str) -> (&str, &str) {
    let base = name.rfind('/').map_or(0, |i| i + 1);
    match name[base..].find('.') {
        Some(dot) => (&name[..base + dot], &name[base + dot + 1..]),
        None => (name, ""),
    }
}

/// Whether a member holds a label this build reads.
pub fn is_label_name(name: &str) -> bool {
    let (_, ext) = split_key(name);
    matches!(ext.to_ascii_lowercase().as_str(), "cls" | "json")
}

/// The label in a `.cls` or `.json` member.
pub fn parse_label(ext: &str, data: &[u8]) -> Result<u32, String> {
    let text = std::str::from_utf8(data).map_err(|_| "the label is not UTF-8 text".to_string())?;
    let number = |v: &serde_json::Value| -> Option<u32> {
        v.as_u64()
            .or_else(|| v.as_str().and_then(|s| s.trim().parse().ok()))
            .and_then(|n| u32::try_from(n).ok())
    };
    if ext.eq_ignore_ascii_case("cls") {
        return text
            .trim()
            .parse::<u32>()
            .map_err(|_| format!("the .cls label `{}` is not a class number", text.trim()));
    }
    let v: serde_json::Value =
        serde_json::from_str(text).map_err(|e| format!("the .json label is not JSON: {e}"))?;
    number(&v)
        .or_else(|| v.get("label").and_then(number))
        .or_else(|| v.get("cls").and_then(number))
        .ok_or_else(|| {
            "the .json label holds no class number (a number, or a `label` or `cls` field)".into()
        })
}

/// One sample to pack into a shard.
pub struct PackSample<'a> {
    pub key: &'a str,
    /// Image extension (`png`, `jpg`).
    pub ext: &'a str,
    pub image: &'a [u8],
    pub label: u32,
}

/// A WebDataset shard: each sample as `<key>.<ext>` and `<key>.cls`.
pub fn pack_shard(samples: &[PackSample<'_>]) -> Result<Vec<u8>, String> {
    let mut builder = tar::Builder::new(Vec::new());
    for s in samples {
        let label = s.label.to_string();
        for (name, data) in [
            (format!("{}.{}", s.key, s.ext), s.image),
            (format!("{}.cls", s.key), label.as_bytes()),
        ] {
            let mut header = tar::Header::new_ustar();
            header.set_size(data.len() as u64);
            header.set_mode(0o644);
            header.set_mtime(0);
            header.set_entry_type(tar::EntryType::Regular);
            builder
                .append_data(&mut header, &name, data)
                .map_err(|e| format!("cannot add {name}: {e}"))?;
        }
    }
    builder.into_inner().map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn braces_expand_ranges_and_lists() {
        assert_eq!(
            expand_braces("s-{008..010}.tar").unwrap(),
            ["s-008.tar", "s-009.tar", "s-010.tar"]
        );
        assert_eq!(
            expand_braces("{a,b}/x-{0..1}").unwrap(),
            ["a/x-0", "a/x-1", "b/x-0", "b/x-1"]
        );
        assert_eq!(expand_braces("plain.tar").unwrap(), ["plain.tar"]);
        for bad in ["s-{1..}.tar", "s-{3..1}", "s-{0..2", "s-}"] {
            assert!(expand_braces(bad).is_err(), "{bad}");
        }
    }

    fn scan(tar: &[u8], chunk: usize) -> Result<Vec<TarMember>, String> {
        let mut s = TarScanner::new(is_label_name);
        for c in tar.chunks(chunk) {
            s.feed(c)?;
        }
        s.finish()
    }

    fn sample_shard() -> Vec<u8> {
        let long_key = format!("deep/{}/k", "d".repeat(120));
        let imgs: Vec<Vec<u8>> = (0..3u8).map(|i| vec![i; 700 + usize::from(i)]).collect();
        let keys = ["a", "b", long_key.as_str()];
        let samples: Vec<PackSample<'_>> = (0..3)
            .map(|i| PackSample {
                key: keys[i],
                ext: "png",
                image: &imgs[i],
                label: i as u32 + 4,
            })
            .collect();
        pack_shard(&samples).unwrap()
    }

    #[test]
    fn scanner_finds_members_in_any_chunking() {
        let tar = sample_shard();
        let whole = scan(&tar, tar.len()).unwrap();
        for chunk in [1, 7, 512, 1000] {
            assert_eq!(scan(&tar, chunk).unwrap(), whole, "chunks of {chunk}");
        }
        assert_eq!(whole.len(), 6);
        let img = &whole[4];
        assert!(
            img.name.ends_with("/k.png") && img.name.len() > 100,
            "{}",
            img.name
        );
        let (o, l) = (img.offset as usize, img.len as usize);
        assert_eq!(&tar[o..o + l], vec![2u8; 702].as_slice());
        // Every member's checksum is that of its bytes, whatever the chunking.
        for m in &whole {
            let (o, l) = (m.offset as usize, m.len as usize);
            assert_eq!(m.crc32, crc32fast::hash(&tar[o..o + l]), "{}", m.name);
        }
        assert_ne!(whole[0].crc32, whole[2].crc32);
        assert_eq!(whole[5].data.as_deref(), Some(&b"6"[..]));
        assert_eq!(whole[0].data, None, "images are not kept");
    }

    #[test]
    fn truncation_and_garbage_are_errors() {
        let tar = sample_shard();
        let cut = scan(&tar[..1500], 100).unwrap_err();
        assert!(cut.contains("truncated") && cut.contains("a.png"), "{cut}");
        let mut bad = tar.clone();
        bad[1540] ^= 0xff; // the second header's name (a.png fills 512..1212, padded to 1536)
        assert!(scan(&bad, 512).unwrap_err().contains("checksum"));
        assert!(scan(&[7u8; 1024], 512).is_err());
    }

    #[test]
    fn keys_and_labels() {
        assert_eq!(split_key("a/b.c.jpg"), ("a/b", "c.jpg"));
        assert_eq!(split_key("x.d/y.png"), ("x.d/y", "png"));
        assert_eq!(parse_label("cls", b" 7\n").unwrap(), 7);
        assert_eq!(parse_label("json", b"{\"label\": 3}").unwrap(), 3);
        assert_eq!(parse_label("json", b"5").unwrap(), 5);
        assert!(parse_label("cls", b"cat").is_err());
        assert!(parse_label("json", b"{\"name\": 1}").is_err());
    }
}

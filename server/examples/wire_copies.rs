//! The dense data path's CPU cost, before and after zero-copy framing:
//! encode, receive and decode of one 1.32M-parameter dense push and its
//! dense reply, in process (no network), on the calling thread's CPU clock.
//!
//! "before" repeats the steps the path took until it was rebuilt: the
//! shard's gradient copied out of the whole gradient, cloned for the
//! request, archived into a growing buffer, copied behind a length prefix;
//! the receiver's buffer grown by doubling as chunks arrive, copied into an
//! aligned buffer, then validated and decoded. "after" is what
//! `ps_net::protocol` and `ps_net::transport` do now: the archive written
//! once from a borrowed slice into a buffer of the right size, the chunks
//! copied once into an aligned buffer where the archive is validated, and
//! its values decoded once. Both receive the frame as the transport hands
//! it on: chunks of `--chunk` bytes.
//!
//!     cargo run --release -p ps-server --example wire_copies -- [--params N] [--reps R] [--chunk B] [--fresh-pages 1]

use std::time::Duration;

use bytes::Bytes;
use ps_net::protocol::{
    decode_request, decode_response, encode_response_frame, encode_step, AlignedVec, GradView,
    ParamUpdate, Request, Response, ValuesView, WireGrad, WireValues, FRAME_HEADER_BYTES,
};
use ps_server::optimizer::thread_cpu_time;
use rkyv::rancor;

/// The frame as the transport hands it on: chunks sharing the frame.
fn chunks(frame: &Bytes, chunk: usize) -> Vec<Bytes> {
    (FRAME_HEADER_BYTES..frame.len())
        .step_by(chunk)
        .map(|at| frame.slice(at..(at + chunk).min(frame.len())))
        .collect()
}

/// The old receive: a buffer grown by doubling from 64 KiB as chunks
/// arrive, then copied into an aligned buffer for validation.
fn old_receive(parts: &[Bytes], len: usize) -> AlignedVec {
    let mut payload: Vec<u8> = Vec::with_capacity(len.min(64 << 10));
    for c in parts {
        let need = payload.len() + c.len();
        if need > payload.capacity() {
            let target = need.max(payload.capacity() * 2).min(len);
            payload.reserve_exact(target - payload.len());
        }
        payload.extend_from_slice(c);
    }
    let mut aligned = AlignedVec::with_capacity(payload.len());
    aligned.extend_from_slice(&payload);
    aligned
}

/// The new receive: the chunks copied once into an aligned buffer.
fn new_receive(parts: &[Bytes], len: usize) -> AlignedVec {
    let mut payload = AlignedVec::with_capacity(len);
    for c in parts {
        payload.extend_from_slice(c);
    }
    payload
}

/// The old encoding: archive into a growing buffer, then copy behind the
/// length prefix.
fn old_frame<T>(msg: &T) -> Bytes
where
    T: for<'a> rkyv::Serialize<
        rkyv::api::high::HighSerializer<
            AlignedVec,
            rkyv::ser::allocator::ArenaHandle<'a>,
            rancor::Error,
        >,
    >,
{
    let payload = rkyv::to_bytes::<rancor::Error>(msg).expect("encodes");
    let mut frame = Vec::with_capacity(FRAME_HEADER_BYTES + payload.len());
    frame.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    frame.extend_from_slice(&payload);
    Bytes::from(frame)
}

fn new_frame(header: [u8; 4], payload: &Bytes) -> Bytes {
    // Only to cut the frame into chunks as the transport would; the real
    // path writes the header and the shared archive without this copy.
    let mut b = Vec::with_capacity(4 + payload.len());
    b.extend_from_slice(&header);
    b.extend_from_slice(payload);
    Bytes::from(b)
}

struct Costs {
    push_encode: Duration,
    push_receive: Duration,
    push_decode: Duration,
    reply_encode: Duration,
    reply_receive: Duration,
    reply_decode: Duration,
}

impl Costs {
    fn total(&self) -> Duration {
        self.push_encode
            + self.push_receive
            + self.push_decode
            + self.reply_encode
            + self.reply_receive
            + self.reply_decode
    }
}

/// Reads one stage's time.
type Stage = fn(&Costs) -> Duration;

fn timed<R>(spent: &mut Duration, f: impl FnOnce() -> R) -> R {
    let t0 = thread_cpu_time();
    let r = f();
    *spent += thread_cpu_time().saturating_sub(t0);
    r
}

fn run(old: bool, grad: &[f32], params: &[f32], chunk: usize, reps: usize) -> (Costs, f64) {
    let mut c = Costs {
        push_encode: Duration::ZERO,
        push_receive: Duration::ZERO,
        push_decode: Duration::ZERO,
        reply_encode: Duration::ZERO,
        reply_receive: Duration::ZERO,
        reply_decode: Duration::ZERO,
    };
    let mut check = 0.0f64;
    for rep in 0..reps {
        // Push: worker to server.
        let (frame, frame_for_chunks) = timed(&mut c.push_encode, || {
            if old {
                let part = WireGrad::Dense(WireValues::F32(grad.to_vec()));
                let req = Request::Step {
                    shard: 0,
                    step: rep as u64,
                    have_version: Some(rep as u64),
                    rate: 0.0,
                    grad: part.clone(),
                };
                let f = old_frame(&req);
                (None, f)
            } else {
                let f = encode_step(
                    0,
                    rep as u64,
                    Some(rep as u64),
                    0.0,
                    GradView::Dense(ValuesView::F32(grad)),
                )
                .expect("encodes");
                (Some(f), Bytes::new())
            }
        });
        let frame_for_chunks = match &frame {
            Some(f) => new_frame(f.header(), f.payload()),
            None => frame_for_chunks,
        };
        let parts = chunks(&frame_for_chunks, chunk);
        let len = frame_for_chunks.len() - FRAME_HEADER_BYTES;
        let payload = timed(&mut c.push_receive, || {
            if old {
                old_receive(&parts, len)
            } else {
                new_receive(&parts, len)
            }
        });
        let req = timed(&mut c.push_decode, || {
            decode_request(&payload).expect("decodes")
        });
        if let Request::Step {
            grad: WireGrad::Dense(WireValues::F32(v)),
            ..
        } = &req
        {
            check += f64::from(v[rep % v.len()]);
        }
        drop((req, payload, parts));
        // Reply: server to worker (the core's response, built alike for
        // both paths, is not timed).
        let resp = Response::Params {
            shard: 0,
            version: rep as u64 + 1,
            next_step: rep as u64 + 1,
            live_workers: 2,
            splits: Vec::new(),
            update: ParamUpdate::Dense(params.to_vec()),
        };
        let (encoded, old_bytes) = timed(&mut c.reply_encode, || {
            if old {
                (None, old_frame(&resp))
            } else {
                (
                    Some(encode_response_frame(&resp).expect("encodes")),
                    Bytes::new(),
                )
            }
        });
        let frame = match &encoded {
            Some(f) => new_frame(f.header(), f.payload()),
            None => old_bytes,
        };
        let parts = chunks(&frame, chunk);
        let len = frame.len() - FRAME_HEADER_BYTES;
        let payload = timed(&mut c.reply_receive, || {
            if old {
                old_receive(&parts, len)
            } else {
                new_receive(&parts, len)
            }
        });
        let resp = timed(&mut c.reply_decode, || {
            decode_response(&payload).expect("decodes")
        });
        if let Response::Params {
            update: ParamUpdate::Dense(v),
            ..
        } = &resp
        {
            check += f64::from(v[rep % v.len()]);
        }
    }
    (c, check)
}

fn arg(name: &str, default: usize) -> usize {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .map(|v| v.parse().expect("a number"))
        .unwrap_or(default)
}

fn main() {
    // Keep freed buffers in the heap: every path then reuses pages already
    // mapped, and the clock measures the copying, not how the allocator
    // happens to map and fault in fresh pages for one order of
    // allocations or the other (`--fresh-pages 1` leaves glibc's default).
    if arg("--fresh-pages", 0) == 0 {
        // SAFETY: mallopt only changes allocator tuning parameters.
        unsafe {
            libc::mallopt(libc::M_MMAP_THRESHOLD, 256 << 20);
            libc::mallopt(libc::M_TRIM_THRESHOLD, 1 << 30);
        }
    }
    let n = arg("--params", 1_320_000);
    let reps = arg("--reps", 200);
    let chunk = arg("--chunk", 1200);
    let grad: Vec<f32> = (0..n).map(|i| (i % 1000) as f32 * 1e-3).collect();
    let params: Vec<f32> = (0..n).map(|i| (i % 777) as f32 * 1e-2).collect();
    // Alternate the two paths in rounds so that load from other jobs falls
    // on both alike.
    let rounds = 10;
    let mut old_all = Vec::new();
    let mut new_all = Vec::new();
    let mut sum = 0.0;
    for _ in 0..rounds {
        let (o, a) = run(true, &grad, &params, chunk, reps / rounds);
        let (nw, b) = run(false, &grad, &params, chunk, reps / rounds);
        sum += a - b;
        old_all.push(o);
        new_all.push(nw);
    }
    assert!(sum.abs() < 1e-6, "both paths decode the same values");
    let per = |cs: &[Costs], f: fn(&Costs) -> Duration| {
        cs.iter().map(f).sum::<Duration>().as_secs_f64() * 1e3 / (reps / rounds * rounds) as f64
    };
    let mb = 4.0 * n as f64 / 1e6;
    println!(
        "dense push + reply of {n} f32 ({mb:.2} MB each way), {} repetitions, chunks of {chunk} B; CPU ms per exchange (thread clock):",
        reps / rounds * rounds
    );
    println!(
        "{:<14} {:>10} {:>10} {:>10}",
        "stage", "before", "after", "after/before"
    );
    let stages: [(&str, Stage); 7] = [
        ("push encode", |c| c.push_encode),
        ("push receive", |c| c.push_receive),
        ("push decode", |c| c.push_decode),
        ("reply encode", |c| c.reply_encode),
        ("reply receive", |c| c.reply_receive),
        ("reply decode", |c| c.reply_decode),
        ("total", Costs::total),
    ];
    for (name, f) in stages {
        let (b, a) = (per(&old_all, f), per(&new_all, f));
        println!("{name:<14} {b:>10.3} {a:>10.3} {:>10.2}x", a / b);
    }
}

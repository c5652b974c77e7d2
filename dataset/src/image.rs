//! Decoding and augmenting encoded images (JPEG, PNG) into feature rows.
//!
//! A decoded sample is `channels × height × width` f32 values in `[0, 1]`
//! (channel-major, the layout a convolution takes), resized to the dataset's
//! shape when the image has another size (shorter side first, then a centre
//! crop). Training samples then go through the [`Augment`] steps, each drawn
//! from a generator seeded by `(seed, epoch, sample)`: a resumed run, or the
//! same sample on another worker, sees the same crop and flip.

use std::sync::Arc;

use image::imageops::FilterType;
use image::DynamicImage;
use ps_shared::rng::StreamRng;

/// Augmentation of training images. The default does nothing.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Augment {
    /// Random crop of the original size from the image padded with this many
    /// zero pixels on each side (0: no crop).
    pub pad: usize,
    /// Flip left-right with probability one half.
    pub hflip: bool,
    /// Per-channel mean subtracted after scaling to `[0, 1]` (empty: none).
    pub mean: Vec<f32>,
    /// Per-channel standard deviation divided by (empty: none).
    pub std: Vec<f32>,
}

impl Augment {
    /// Checks the normalisation against the image channels.
    pub fn check(&self, channels: usize) -> Result<(), String> {
        for (name, v) in [("mean", &self.mean), ("std", &self.std)] {
            if !v.is_empty() && v.len() != channels {
                return Err(format!(
                    "{name} has {} values for {channels} channels",
                    v.len()
                ));
            }
            if v.iter().any(|x| !x.is_finite()) {
                return Err(format!("{name} holds a value that is not finite"));
            }
        }
        if self.std.iter().any(|&s| s <= 0.0) {
            return Err("std values must be above 0".into());
        }
        Ok(())
    }

    fn is_random(&self) -> bool {
        self.pad > 0 || self.hflip
    }
}

/// How a loader turns encoded images into rows, shared by its decode threads.
#[derive(Clone)]
pub struct ImagePipeline {
    pub augment: Augment,
    /// Seed of the per-sample augmentation streams.
    pub seed: u64,
    /// Drop undecodable samples from their batch (and count them) instead of
    /// failing the run.
    pub skip_bad: bool,
    /// The bounded pool images are decoded on.
    pub pool: Arc<rayon::ThreadPool>,
    /// Threads in `pool`.
    pub threads: usize,
}

impl std::fmt::Debug for ImagePipeline {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ImagePipeline")
            .field("augment", &self.augment)
            .field("seed", &self.seed)
            .field("skip_bad", &self.skip_bad)
            .field("threads", &self.threads)
            .finish()
    }
}

impl ImagePipeline {
    /// A pipeline decoding on `threads` threads of its own.
    pub fn new(
        augment: Augment,
        seed: u64,
        threads: usize,
        skip_bad: bool,
    ) -> Result<Self, String> {
        let threads = threads.max(1);
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("decode-{i}"))
            .build()
            .map_err(|e| format!("cannot start {threads} decode threads: {e}"))?;
        Ok(Self {
            augment,
            seed,
            skip_bad,
            pool: Arc::new(pool),
            threads,
        })
    }
}

/// Decodes one JPEG or PNG into `shape = [channels, height, width]` values in
/// `[0, 1]`, channel-major. Colour images become grey for one channel and
/// grey images are repeated for three.
pub fn decode_image(bytes: &[u8], shape: [usize; 3]) -> Result<Vec<f32>, String> {
    let [c, h, w] = shape;
    let img = image::load_from_memory(bytes).map_err(|e| format!("cannot decode: {e}"))?;
    let img = fit(img, w as u32, h as u32);
    let mut out = vec![0.0f32; c * h * w];
    let plane = h * w;
    if c == 1 {
        let grey = img.into_luma8();
        for (o, p) in out.iter_mut().zip(grey.as_raw()) {
            *o = f32::from(*p) / 255.0;
        }
    } else {
        let rgb = img.into_rgb8();
        for (i, px) in rgb.as_raw().chunks_exact(3).enumerate() {
            for (ch, v) in px.iter().enumerate() {
                out[ch * plane + i] = f32::from(*v) / 255.0;
            }
        }
    }
    Ok(out)
}

/// Resizes so that the image covers `w × h` (shorter side first), then
/// crops the centre.
fn fit(img: DynamicImage, w: u32, h: u32) -> DynamicImage {
    if img.width() == w && img.height() == h {
        return img;
    }
    let scale = f64::max(
        f64::from(w) / f64::from(img.width()),
        f64::from(h) / f64::from(img.height()),
    );
    let rw = ((f64::from(img.width()) * scale).round() as u32).max(w);
    let rh = ((f64::from(img.height()) * scale).round() as u32).max(h);
    let resized = img.resize_exact(rw, rh, FilterType::Triangle);
    resized.crop_imm((rw - w) / 2, (rh - h) / 2, w, h)
}

/// The augmentation stream of one sample in one epoch, from the project's
/// own generator so no dependency upgrade changes a run's crops and flips.
pub fn sample_rng(seed: u64, epoch: u64, sample: usize) -> StreamRng {
    let mut z = seed ^ 0x9e37_79b9_7f4a_7c15;
    for v in [epoch, sample as u64] {
        z = (z ^ v).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z ^= z >> 31;
    }
    StreamRng::seed_from_u64(z)
}

/// Applies `augment` to one decoded sample in place. `rng` is `None` for
/// evaluation: only the normalisation runs.
pub fn augment_in_place(
    chw: &mut [f32],
    shape: [usize; 3],
    augment: &Augment,
    rng: Option<&mut StreamRng>,
) {
    let [c, h, w] = shape;
    if let Some(rng) = rng.filter(|_| augment.is_random()) {
        let pad = augment.pad;
        let (dy, dx) = if pad > 0 {
            (
                rng.in_inclusive(0, 2 * pad as u64) as usize,
                rng.in_inclusive(0, 2 * pad as u64) as usize,
            )
        } else {
            (pad, pad)
        };
        let flip = augment.hflip && rng.chance(0.5);
        let src = chw.to_vec();
        for ch in 0..c {
            let plane = &src[ch * h * w..(ch + 1) * h * w];
            for y in 0..h {
                // Output (y, x) reads padded (y + dy, x + dx), i.e. source
                // (y + dy - pad, x + dx - pad); outside the image it is 0.
                let sy = (y + dy).checked_sub(pad).filter(|&v| v < h);
                for x in 0..w {
                    let ox = if flip { w - 1 - x } else { x };
                    let sx = (ox + dx).checked_sub(pad).filter(|&v| v < w);
                    chw[ch * h * w + y * w + x] = match (sy, sx) {
                        (Some(sy), Some(sx)) => plane[sy * w + sx],
                        _ => 0.0,
                    };
                }
            }
        }
    }
    if !augment.mean.is_empty() || !augment.std.is_empty() {
        for ch in 0..c {
            let m = augment.mean.get(ch).copied().unwrap_or(0.0);
            let s = augment.std.get(ch).copied().unwrap_or(1.0);
            for v in &mut chw[ch * h * w..(ch + 1) * h * w] {
                *v = (*v - m) / s;
            }
        }
    }
}

/// Encodes a `channels × height × width` sample with values in `[0, 1]` as
/// PNG (lossless) or JPEG (`quality` 1..=100).
pub fn encode_image(chw: &[f32], shape: [usize; 3], format: EncodeAs) -> Result<Vec<u8>, String> {
    let [c, h, w] = shape;
    if chw.len() != c * h * w || !(c == 1 || c == 3) {
        return Err(format!(
            "{} values do not make an image of shape {shape:?}",
            chw.len()
        ));
    }
    let plane = h * w;
    let byte = |v: f32| (v.clamp(0.0, 1.0) * 255.0).round() as u8;
    let img = if c == 1 {
        let raw: Vec<u8> = chw.iter().map(|&v| byte(v)).collect();
        DynamicImage::ImageLuma8(
            image::GrayImage::from_raw(w as u32, h as u32, raw).ok_or("bad image size")?,
        )
    } else {
        let mut raw = vec![0u8; 3 * plane];
        for i in 0..plane {
            for ch in 0..3 {
                raw[3 * i + ch] = byte(chw[ch * plane + i]);
            }
        }
        DynamicImage::ImageRgb8(
            image::RgbImage::from_raw(w as u32, h as u32, raw).ok_or("bad image size")?,
        )
    };
    let mut out = std::io::Cursor::new(Vec::new());
    match format {
        EncodeAs::Png => img
            .write_to(&mut out, image::ImageFormat::Png)
            .map_err(|e| e.to_string())?,
        EncodeAs::Jpeg(quality) => {
            let enc = image::codecs::jpeg::JpegEncoder::new_with_quality(&mut out, quality);
            img.write_with_encoder(enc).map_err(|e| e.to_string())?
        }
    }
    Ok(out.into_inner())
}

/// The encoding [`encode_image`] writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EncodeAs {
    Png,
    Jpeg(u8),
}

impl EncodeAs {
    /// The file extension.
    pub fn extension(self) -> &'static str {
        match self {
            EncodeAs::Png => "png",
            EncodeAs::Jpeg(_) => "jpg",
        }
    }
}

/// Whether a file name ends in an image extension this build decodes.
pub fn is_image_name(name: &str) -> bool {
    let lower = name.to_ascii_lowercase();
    [".jpg", ".jpeg", ".png"].iter().any(|e| lower.ends_with(e))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ramp(shape: [usize; 3]) -> Vec<f32> {
        let n: usize = shape.iter().product();
        (0..n).map(|i| (i % 251) as f32 / 250.0).collect()
    }

    #[test]
    fn png_round_trips_exactly_to_8_bits() {
        for shape in [[1, 5, 7], [3, 4, 6]] {
            let x = ramp(shape);
            let png = encode_image(&x, shape, EncodeAs::Png).unwrap();
            let y = decode_image(&png, shape).unwrap();
            for (a, b) in x.iter().zip(&y) {
                assert!((a - b).abs() <= 0.5 / 255.0 + 1e-6, "{a} vs {b}");
            }
        }
    }

    #[test]
    fn jpeg_decodes_close_and_resizes() {
        let shape = [3, 16, 16];
        let x = vec![0.5f32; 3 * 256];
        let jpg = encode_image(&x, shape, EncodeAs::Jpeg(95)).unwrap();
        let y = decode_image(&jpg, shape).unwrap();
        assert!(y.iter().all(|v| (v - 0.5).abs() < 0.03));
        // A 16x16 image asked for as 8x8 grey is scaled down, not refused.
        let small = decode_image(&jpg, [1, 8, 8]).unwrap();
        assert_eq!(small.len(), 64);
        assert!(small.iter().all(|v| (v - 0.5).abs() < 0.05));
        // A wide image is resized on its shorter side and centre-cropped.
        let wide = encode_image(&vec![0.2f32; 8 * 32], [1, 8, 32], EncodeAs::Png).unwrap();
        assert_eq!(decode_image(&wide, [1, 16, 16]).unwrap().len(), 256);
    }

    #[test]
    fn garbage_is_an_error_not_a_panic() {
        let err = decode_image(b"\xff\xd8\xff\xe0 not really a jpeg", [1, 4, 4]).unwrap_err();
        assert!(err.contains("cannot decode"), "{err}");
        let png = encode_image(&ramp([1, 8, 8]), [1, 8, 8], EncodeAs::Png).unwrap();
        assert!(decode_image(&png[..png.len() / 2], [1, 8, 8]).is_err());
    }

    #[test]
    fn crop_and_flip_move_pixels_and_are_seeded() {
        let shape = [1, 4, 4];
        let x: Vec<f32> = (0..16).map(|i| i as f32).collect();
        let flip = Augment {
            hflip: true,
            ..Augment::default()
        };
        // Find a seed that flips, then check the flip is exact.
        let (mut flipped, mut kept) = (0, 0);
        for s in 0..32 {
            let mut y = x.clone();
            augment_in_place(&mut y, shape, &flip, Some(&mut sample_rng(7, 0, s)));
            if y == x {
                kept += 1;
            } else {
                flipped += 1;
                assert_eq!(&y[..4], &[3.0, 2.0, 1.0, 0.0]);
            }
        }
        assert!(flipped > 5 && kept > 5, "{flipped} flipped, {kept} kept");

        let crop = Augment {
            pad: 1,
            ..Augment::default()
        };
        let run = |epoch, sample| {
            let mut y = x.clone();
            augment_in_place(
                &mut y,
                shape,
                &crop,
                Some(&mut sample_rng(7, epoch, sample)),
            );
            y
        };
        assert_eq!(run(3, 9), run(3, 9), "same seed, same crop");
        let distinct: std::collections::HashSet<Vec<u32>> = (0..40)
            .map(|s| run(0, s).iter().map(|v| v.to_bits()).collect())
            .collect();
        assert!(distinct.len() > 3, "{} distinct crops", distinct.len());
        // Every crop keeps the 2x2 centre of the image somewhere.
        for s in 0..40 {
            assert!(run(0, s).contains(&5.0));
        }
        // Evaluation only normalises.
        let norm = Augment {
            pad: 2,
            hflip: true,
            mean: vec![1.0],
            std: vec![2.0],
        };
        let mut y = x.clone();
        augment_in_place(&mut y, shape, &norm, None);
        assert_eq!(y[3], 1.0);
        assert!(norm.check(3).is_err());
        assert!(norm.check(1).is_ok());
    }
}

//! `ps-data images --from-folder` packs a user's folder of images
//! into WebDataset shards as they are, and `ps-data index` finds them again.

use std::path::Path;
use std::process::Command;

use ps_dataset::image::{encode_image, EncodeAs};

fn ps_data(args: &[&str]) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_ps-data"))
        .args(args)
        .output()
        .expect("run ps-data");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

fn write_png(path: &Path, shade: f32) {
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    let png = encode_image(&[shade; 64], [1, 8, 8], EncodeAs::Png).unwrap();
    std::fs::write(path, png).unwrap();
}

fn manifest(dir: &Path) -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(dir.join("manifest.json")).unwrap()).unwrap()
}

#[test]
fn a_folder_of_images_is_packed_indexed_and_checked() {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src");
    for (class, n) in [("ant", 3), ("bee", 2)] {
        for i in 0..n {
            write_png(&src.join(format!("train/{class}/{i}.png")), 0.1 * i as f32);
        }
    }
    write_png(&src.join("test/bee/t.png"), 0.5);
    std::fs::write(src.join("train/ant/notes.txt"), "not an image").unwrap();
    let out = tmp.path().join("wds");
    let url = format!("file://{}", out.display());
    let src_arg = src.to_str().unwrap();
    let (ok, text) = ps_data(&[
        "images",
        "--from-folder",
        src_arg,
        "--shape",
        "1,8,8",
        "--out",
        &url,
        "--layout",
        "webdataset",
        "--per-shard",
        "2",
    ]);
    assert!(ok, "{text}");
    let m = manifest(&out);
    assert_eq!(m["layout"], "webdataset");
    assert_eq!(m["train"]["num_samples"], 5);
    assert_eq!(m["test"]["num_samples"], 1);
    assert_eq!(m["images"]["class_names"], serde_json::json!(["0", "1"]));
    assert_eq!(m["images"]["objects"].as_array().unwrap().len(), 3 + 1);
    assert!(out.join("train-0002.tar").exists());

    // Indexing the shards again gives the same entries.
    std::fs::remove_file(out.join("manifest.json")).unwrap();
    let (ok, text) = ps_data(&[
        "index",
        "--url",
        &url,
        "--layout",
        "webdataset",
        "--train",
        "train-{0000..0002}.tar",
        "--test",
        "test-0000.tar",
        "--shape",
        "1,8,8",
    ]);
    assert!(ok, "{text}");
    assert!(text.contains("5 train + 1 test images"), "{text}");
    assert_eq!(manifest(&out)["images"]["train"], m["images"]["train"]);

    // A test class the training folders do not have is named.
    write_png(&src.join("test/cow/c.png"), 0.2);
    let other = format!("file://{}", tmp.path().join("x").display());
    let (ok, text) = ps_data(&[
        "images",
        "--from-folder",
        src_arg,
        "--shape",
        "1,8,8",
        "--out",
        &other,
    ]);
    assert!(!ok);
    assert!(
        text.contains("`cow`") && text.contains("no training folder"),
        "{text}"
    );
}

//! The server's AdamW update (fused pass, warm-up + cosine schedule,
//! global-norm clipping, a no-decay group) against torch's, step for step.
//!
//! The fixture was written by `scripts/make-adamw-fixture.py` from
//! torch.optim.AdamW, LambdaLR and clip_grad_norm_; this test needs no Python.

use std::ops::Range;

use ps_server::optimizer::{fused_update_planned, UpdatePlan};
use ps_shared::config::{OptimizerKind, OptimizerSection, ScheduleKind, ScheduleSection};
use serde_json::Value;

const FIXTURE: &str = include_str!("../../tests/fixtures/adamw-warmup-cosine.json");

fn f32s(v: &Value) -> Vec<f32> {
    v.as_array()
        .expect("an array")
        .iter()
        .map(|x| x.as_f64().expect("a number") as f32)
        .collect()
}

fn num(v: &Value, key: &str) -> f64 {
    v[key].as_f64().unwrap_or_else(|| panic!("config.{key}"))
}

#[test]
fn adamw_with_schedule_clipping_and_no_decay_equals_torch() {
    let fixture: Value = serde_json::from_str(FIXTURE).expect("fixture parses");
    let c = &fixture["config"];
    let rule = OptimizerSection {
        lr: num(c, "lr") as f32,
        kind: OptimizerKind::Adamw,
        beta1: num(c, "beta1") as f32,
        beta2: num(c, "beta2") as f32,
        eps: num(c, "eps") as f32,
        weight_decay: num(c, "weight_decay") as f32,
        clip_grad_norm: num(c, "clip_grad_norm") as f32,
        no_decay: fixture["no_decay"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| p.as_str().unwrap().to_string())
            .collect(),
        schedule: ScheduleSection {
            kind: ScheduleKind::Cosine,
            warmup_steps: num(c, "warmup_steps") as u64,
            warmup_start: num(c, "warmup_start") as f32,
            total_steps: num(c, "total_steps") as u64,
            min_lr: num(c, "min_lr") as f32,
            ..ScheduleSection::default()
        },
        ..OptimizerSection::default()
    };
    let mut segments: Vec<Range<usize>> = Vec::new();
    let mut decay = Vec::new();
    for t in fixture["tensors"].as_array().unwrap() {
        let start = segments.last().map_or(0, |s| s.end);
        segments.push(start..start + t["numel"].as_u64().unwrap() as usize);
        decay.push(rule.decays(t["name"].as_str().unwrap()));
    }
    assert_eq!(
        decay,
        vec![true, false],
        "the bias is in the no-decay group"
    );

    let mut params = f32s(&fixture["initial"]);
    let mut state = vec![0.0f32; 2 * params.len()];
    let steps = fixture["steps"].as_array().unwrap();
    assert!(steps.len() >= 5);
    let (mut clipped, mut unclipped) = (0, 0);
    let mut worst = 0.0f64;
    for (k, s) in steps.iter().enumerate() {
        let step = k as u64;
        let torch_lr = s["lr"].as_f64().unwrap();
        let lr = f64::from(rule.lr_at(step));
        assert!(
            (lr - torch_lr).abs() <= 1e-6 * torch_lr,
            "step {k}: rate {lr} vs torch {torch_lr}"
        );
        if s["norm"].as_f64().unwrap() > f64::from(rule.clip_grad_norm) {
            clipped += 1;
        } else {
            unclipped += 1;
        }
        let grad = f32s(&s["grad"]);
        let plan = UpdatePlan {
            segments: &segments,
            decay: &decay,
            step,
        };
        fused_update_planned(&mut params, &grad, &mut state, &plan, &rule, 1.0).unwrap();
        let expected = f32s(&s["params"]);
        for (i, (&ours, &theirs)) in params.iter().zip(&expected).enumerate() {
            let rel = f64::from((ours - theirs).abs()) / f64::from(theirs.abs()).max(1e-3);
            worst = worst.max(rel);
            assert!(
                rel <= 1e-5,
                "step {k}, entry {i}: {ours} vs torch {theirs} (relative {rel:e})"
            );
        }
    }
    assert!(
        clipped > 0 && unclipped > 0,
        "the fixture exercises both sides of the clip"
    );
    println!(
        "max relative difference to torch over {} steps: {worst:e}",
        steps.len()
    );
}

use super::*;

/// One worker's shard that checkpoints every 2 updates, started from an
/// offer of zeros.
fn checkpointing_every_2(t0: Instant) -> ShardCore {
    let settings = CoreSettings {
        checkpoint_every: 2,
        ..CoreSettings::default()
    };
    let mut c = joined(1, settings, t0);
    c.handle(offer(0, 0, vec![0.0; 8]), t0);
    c
}

/// The checkpoint write of `version` ended, `ok` or not.
fn done(version: u64, ok: bool) -> Event {
    Event::CheckpointDone { version, ok }
}

#[test]
fn checkpoints_are_due_every_n_updates_and_on_shutdown() {
    let t0 = Instant::now();
    let mut c = checkpointing_every_2(t0);
    let mut written = vec![];
    for s in 0..5 {
        for a in c.handle(step(s, 0, s, sparse(vec![0], vec![1.0])), t0) {
            if let Action::Checkpoint(ck) = a {
                written.push(ck.version);
                c.handle(done(ck.version, true), t0);
            }
        }
    }
    assert_eq!(written, vec![2, 4]);
    let acts = c.handle(Event::Shutdown, t0);
    assert!(acts
        .iter()
        .any(|a| matches!(a, Action::Checkpoint(ck) if ck.version == 5)));
    assert!(c.checkpoint_outstanding());
    c.handle(done(5, true), t0);
    assert!(!c.checkpoint_outstanding());
}

#[test]
fn the_final_checkpoint_waits_for_the_write_under_way() {
    let t0 = Instant::now();
    let mut c = checkpointing_every_2(t0);
    let checkpoints = |acts: &[Action]| {
        acts.iter()
            .filter_map(|a| match a {
                Action::Checkpoint(ck) => Some(ck.version),
                _ => None,
            })
            .collect::<Vec<_>>()
    };
    let mut due = vec![];
    for s in 0..3 {
        due.extend(checkpoints(
            &c.handle(step(s, 0, s, sparse(vec![0], vec![1.0])), t0),
        ));
    }
    // The write of version 2 is under way when the server stops at 3.
    assert_eq!(due, vec![2]);
    assert!(checkpoints(&c.handle(Event::Shutdown, t0)).is_empty());
    assert!(c.checkpoint_outstanding());
    let acts = c.handle(done(2, true), t0);
    assert_eq!(checkpoints(&acts), vec![3]);
    assert!(c.checkpoint_outstanding());
    // A failed final write is not retried: the stop goes on without it.
    let acts = c.handle(done(3, false), t0);
    assert!(checkpoints(&acts).is_empty());
    assert!(!c.checkpoint_outstanding());
}

//! Locks that outlive a panic.
//!
//! The mutexes here guard counters, caches and bookkeeping that stay valid
//! whatever a panicking holder was doing (each update is a single
//! assignment or insertion). A poisoned lock is therefore taken as it is
//! rather than spreading the panic to every later caller.

use std::sync::{Mutex, MutexGuard, PoisonError};

/// Locks `m`, also when a holder panicked.
///
/// ```
/// use std::sync::Mutex;
///
/// let m = Mutex::new(1);
/// let _ = std::panic::catch_unwind(|| {
///     let _g = m.lock().unwrap();
///     panic!("a holder fails");
/// });
/// assert!(m.is_poisoned());
/// *ps_shared::sync::lock(&m) += 1;
/// assert_eq!(*ps_shared::sync::lock(&m), 2);
/// ```
pub fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

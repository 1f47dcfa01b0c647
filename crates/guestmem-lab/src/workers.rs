//! Timed parallel work for the scenarios that measure threads against each other (`faults`,
//! `translate`), on the library's one worker helper ([`guestmem::workers::Crew`]): every
//! worker is created and waits at its gate before the clock starts, so no thread creation
//! (stack `mmap`, an address-space lock writer) runs inside the timed part.

use std::time::Instant;

use guestmem::workers::Crew;

use crate::error::LabError;

/// What one worker did.
#[derive(Debug, Clone, Copy)]
pub(crate) struct WorkerTime<T> {
    /// Seconds from the worker's own start (after the gate opened) to its end.
    pub seconds: f64,
    /// When it started.
    pub started: Instant,
    /// When it finished.
    pub finished: Instant,
    /// What its work returned.
    pub value: T,
}

/// Runs `work(i)` on `threads` new threads, all started behind one gate; returns the wall
/// seconds from the first worker's start until the last worker's end, and each worker's own
/// time.
pub(crate) fn timed<T: Send>(
    scenario: &'static str,
    threads: usize,
    work: impl Fn(usize) -> T + Sync,
) -> Result<(f64, Vec<WorkerTime<T>>), LabError> {
    let times = Crew::new(scenario)
        .run(threads, |i| {
            let started = Instant::now();
            let value = work(i);
            let finished = Instant::now();
            WorkerTime {
                seconds: (finished - started).as_secs_f64(),
                started,
                finished,
                value,
            }
        })
        .map_err(|source| LabError::Spawn { scenario, source })?;
    let wall = match (
        times.iter().map(|w| w.started).min(),
        times.iter().map(|w| w.finished).max(),
    ) {
        (Some(a), Some(b)) => b.saturating_duration_since(a).as_secs_f64(),
        _ => 0.0,
    };
    Ok((wall, times))
}

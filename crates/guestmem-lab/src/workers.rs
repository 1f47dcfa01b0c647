//! Timed parallel work for the scenarios that measure threads against each other (`faults`,
//! `translate`): every worker is created and waits at a gate before the clock starts, so no
//! thread creation (stack `mmap`, an address-space lock writer) runs inside the timed part.

use std::time::Instant;

use crate::error::LabError;
use crate::peer::Gate;

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
    let gate = Gate::default();
    std::thread::scope(|s| {
        let mut handles = Vec::with_capacity(threads);
        for i in 0..threads {
            let (gate, work) = (&gate, &work);
            let spawned = std::thread::Builder::new()
                .name(format!("{scenario}-{i}"))
                .spawn_scoped(s, move || {
                    if !gate.arrive_and_wait() {
                        return None;
                    }
                    let t = Instant::now();
                    let value = work(i);
                    let finished = Instant::now();
                    Some(WorkerTime {
                        seconds: (finished - t).as_secs_f64(),
                        started: t,
                        finished,
                        value,
                    })
                });
            match spawned {
                Ok(h) => handles.push(h),
                Err(source) => {
                    // Call the run off: the workers already waiting return without work.
                    gate.decide(false);
                    return Err(LabError::Spawn { scenario, source });
                }
            }
        }
        gate.open_when_arrived(handles.len());
        let times: Vec<WorkerTime<T>> = handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|p| std::panic::resume_unwind(p))
                    .expect("the gate opened")
            })
            .collect();
        let wall = match (
            times.iter().map(|w| w.started).min(),
            times.iter().map(|w| w.finished).max(),
        ) {
            (Some(a), Some(b)) => b.saturating_duration_since(a).as_secs_f64(),
            _ => 0.0,
        };
        Ok((wall, times))
    })
}

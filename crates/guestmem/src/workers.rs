//! Worker threads started behind one gate: the one spawn loop that guestmem's jobs, and the
//! lab's peers and timed scenarios, all use.
//!
//! Why a gate: creating a thread maps its stack, and a starting Rust thread maps its signal
//! stack too; each `mmap` takes the address-space lock as a writer, which stalls every other
//! worker faulting pages in under it as a reader (seed 001). So with [`Start::AllArrived`] no
//! worker starts its work until every worker has been created *and has arrived* at the gate
//! (arrival, not just creation: the signal-stack `mmap` happens as the thread starts). The
//! count is only known once creation is over, since a creation may fail: [`Shortfall`] says
//! whether the crew then works with fewer threads (a job, which is correct on any number) or
//! is called off (a measurement, which would be wrong with fewer).

use std::io;
use std::sync::{Condvar, Mutex, MutexGuard, PoisonError};

/// When workers start their work.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Start {
    /// Once every worker has been created and has arrived at the gate (the default, and what
    /// QEMU's `threads_created_flag` does).
    AllArrived,
    /// Each as soon as it runs (Cloud Hypervisor's prefault threads; only the lab's peer
    /// uses it).
    #[cfg_attr(not(feature = "lab-internals"), allow(dead_code))]
    AsCreated,
}

/// Whether the calling thread works as worker 0 or only waits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Caller {
    /// The caller is worker 0 (padata: "the caller works too").
    Works,
    /// The caller creates the workers and waits for them.
    Waits,
}

/// What happens when a worker thread cannot be created.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shortfall {
    /// Go on with the workers that were created.
    RunWithFewer,
    /// Call the run off: workers already waiting return without working, and the creation
    /// error is returned.
    CallOff,
}

/// How to start a crew of workers.
#[derive(Debug, Clone, Copy)]
pub struct Crew {
    /// Thread name.
    pub name: &'static str,
    /// Stack size of each new thread, in bytes (`None`: Rust's default).
    pub stack_bytes: Option<usize>,
    /// When workers start.
    pub start: Start,
    /// Whether the caller works.
    pub caller: Caller,
    /// What a failed thread creation does.
    pub shortfall: Shortfall,
}

impl Crew {
    /// A crew named `name`: all arrived before any works, the caller waits, no shortfall.
    pub fn new(name: &'static str) -> Crew {
        Crew {
            name,
            stack_bytes: None,
            start: Start::AllArrived,
            caller: Caller::Waits,
            shortfall: Shortfall::CallOff,
        }
    }

    /// Sets when workers start.
    #[cfg_attr(not(feature = "lab-internals"), allow(dead_code))]
    pub fn with_start(mut self, start: Start) -> Crew {
        self.start = start;
        self
    }

    /// Sets whether the caller works.
    pub fn with_caller(mut self, caller: Caller) -> Crew {
        self.caller = caller;
        self
    }

    /// Sets what a failed thread creation does.
    pub fn with_shortfall(mut self, shortfall: Shortfall) -> Crew {
        self.shortfall = shortfall;
        self
    }

    /// Sets each new thread's stack size.
    pub fn with_stack_bytes(mut self, bytes: usize) -> Crew {
        self.stack_bytes = Some(bytes);
        self
    }

    /// Runs `work(i)` for each worker `i` in `0..workers` and returns what each returned, in
    /// worker order. With [`Caller::Works`] worker 0 is the calling thread. With
    /// [`Shortfall::RunWithFewer`] fewer results come back when threads could not be created
    /// (at least the caller's, if it works). A worker's panic is resumed on the caller.
    pub fn run<T: Send>(
        &self,
        workers: usize,
        work: impl Fn(usize) -> T + Sync,
    ) -> Result<Vec<T>, io::Error> {
        let first_spawned = match self.caller {
            Caller::Works => 1,
            Caller::Waits => 0,
        };
        if workers == 0 {
            return Ok(Vec::new());
        }
        if workers == 1 && self.caller == Caller::Works {
            return Ok(vec![work(0)]);
        }
        let gate = StartGate::default();
        std::thread::scope(|s| {
            let mut handles = Vec::with_capacity(workers - first_spawned);
            for i in first_spawned..workers {
                let (gate, work) = (&gate, &work);
                let mut b = std::thread::Builder::new();
                // A name with a NUL cannot name a thread; such a crew's threads go unnamed.
                if !self.name.contains('\0') {
                    b = b.name(self.name.into());
                }
                if let Some(bytes) = self.stack_bytes {
                    b = b.stack_size(bytes);
                }
                let start = self.start;
                let spawned = b.spawn_scoped(s, move || {
                    if start == Start::AllArrived && !gate.arrive_and_wait() {
                        return None;
                    }
                    Some(work(i))
                });
                match spawned {
                    Ok(h) => handles.push(h),
                    Err(e) if self.shortfall == Shortfall::CallOff => {
                        gate.decide(false);
                        return Err(e);
                    }
                    Err(_) => break,
                }
            }
            if self.start == Start::AllArrived {
                gate.open_when_arrived(handles.len());
            }
            let mut out = Vec::with_capacity(handles.len() + first_spawned);
            if self.caller == Caller::Works {
                out.push(work(0));
            }
            for h in handles {
                match h.join() {
                    Ok(v) => out.push(v.expect("the gate opened")),
                    Err(panic) => std::panic::resume_unwind(panic),
                }
            }
            Ok(out)
        })
    }
}

/// Holds workers until every created one has arrived, then lets them all go (or calls the run
/// off): a barrier whose count is only known once thread creation is over. Private: used
/// wrongly (waiting for workers that never arrive) it would hang, and [`Crew`] cannot.
#[derive(Default)]
pub(crate) struct StartGate {
    /// Workers arrived, and the decision once made (`true`: work).
    state: Mutex<(usize, Option<bool>)>,
    changed: Condvar,
}

impl StartGate {
    fn lock(&self) -> MutexGuard<'_, (usize, Option<bool>)> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A worker: announces it is ready, then waits for the decision; `true` means work.
    pub(crate) fn arrive_and_wait(&self) -> bool {
        let mut g = self.lock();
        g.0 += 1;
        self.changed.notify_all();
        let g = self
            .changed
            .wait_while(g, |s| s.1.is_none())
            .unwrap_or_else(PoisonError::into_inner);
        g.1 == Some(true)
    }

    /// The creator: waits until `workers` have arrived, then lets them work.
    pub(crate) fn open_when_arrived(&self, workers: usize) {
        let g = self
            .changed
            .wait_while(self.lock(), |s| s.0 < workers)
            .unwrap_or_else(PoisonError::into_inner);
        drop(g);
        self.decide(true);
    }

    /// The creator: lets the workers go (`true`) or calls the run off (`false`).
    pub(crate) fn decide(&self, go: bool) {
        self.lock().1 = Some(go);
        self.changed.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn run_returns_each_workers_result_in_order() {
        for caller in [Caller::Works, Caller::Waits] {
            for start in [Start::AllArrived, Start::AsCreated] {
                let crew = Crew::new("t").with_caller(caller).with_start(start);
                assert_eq!(crew.run(4, |i| i * 10).unwrap(), vec![0, 10, 20, 30]);
                assert!(crew.run(0, |i| i).unwrap().is_empty());
            }
        }
    }

    #[test]
    fn one_worker_that_is_the_caller_runs_on_the_calling_thread() {
        let me = std::thread::current().id();
        let crew = Crew::new("t").with_caller(Caller::Works);
        assert_eq!(
            crew.run(1, |_| std::thread::current().id()).unwrap(),
            vec![me]
        );
        let ids = crew.run(3, |_| std::thread::current().id()).unwrap();
        assert_eq!(ids[0], me);
        assert!(ids[1..].iter().all(|&t| t != me));
    }

    #[test]
    fn a_name_with_nul_runs_unnamed() {
        assert_eq!(Crew::new("a\0b").run(2, |i| i).unwrap(), vec![0, 1]);
    }

    #[test]
    fn call_off_lets_waiting_workers_return_without_work() {
        let gate = StartGate::default();
        let worked = std::thread::scope(|s| {
            let h = s.spawn(|| gate.arrive_and_wait());
            gate.open_when_arrived(0);
            h.join().unwrap()
        });
        assert!(worked);
        let gate = StartGate::default();
        gate.decide(false);
        assert!(!gate.arrive_and_wait());
    }
}

//! Work a fault-serving thread puts off until the faults it read together are served.
//!
//! Waking another thread costs its waker the wake-up: on this project's host (a VM whose
//! CPUs are emulated, where waking a thread on the other CPU is an inter-processor
//! interrupt through the hypervisor) 230 us median for one `mpsc` send to a sleeping
//! cache writer, measured inside a move's remote faults, where the GET itself took
//! 170-350 us. A fault's frame handed to the writers before it was installed paid that
//! on the VM's path. Inside a [`Batch`], such hand-overs wait until the batch ends: after
//! the faults are installed and their vCPUs woken.

use std::cell::RefCell;

type Later = Box<dyn FnOnce()>;

thread_local! {
    /// `Some` while a batch is open on this thread: what waits for its end.
    static LATER: RefCell<Option<Vec<Later>>> = const { RefCell::new(None) };
}

/// While it lives (the outermost on its thread), [`later`] puts work off until it drops.
#[must_use]
pub(crate) struct Batch {
    outermost: bool,
    /// Tied to its thread: the work it holds is that thread's.
    _thread: std::marker::PhantomData<*const ()>,
}

/// Opens a batch on this thread; one opened inside another leaves the work to the outer.
pub(crate) fn batch() -> Batch {
    let outermost = LATER.with(|l| {
        let mut l = l.borrow_mut();
        let outer = l.is_none();
        if outer {
            *l = Some(Vec::new());
        }
        outer
    });
    Batch {
        outermost,
        _thread: std::marker::PhantomData,
    }
}

/// Runs `f` when this thread's batch ends, or now if none is open.
#[cfg_attr(not(feature = "store"), allow(dead_code))]
pub(crate) fn later(f: impl FnOnce() + 'static) {
    let f: Later = Box::new(f);
    let now = LATER.with(|l| match l.borrow_mut().as_mut() {
        Some(queued) => {
            queued.push(f);
            None
        }
        None => Some(f),
    });
    if let Some(f) = now {
        f();
    }
}

impl Drop for Batch {
    fn drop(&mut self) {
        if !self.outermost {
            return;
        }
        // Each runs outside the borrow, and with the batch closed: work that queues more
        // runs it at once. One that panics does not stop the rest (each may be what lets
        // others go on: a count read-ahead waits on, a frame's flight); its panic goes on
        // once all have run, unless this thread is unwinding already.
        let queued = LATER.with(|l| l.borrow_mut().take()).unwrap_or_default();
        let mut first_panic = None;
        for f in queued {
            if let Err(p) = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
                first_panic.get_or_insert(p);
            }
        }
        if let Some(p) = first_panic.filter(|_| !std::thread::panicking()) {
            std::panic::resume_unwind(p);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;
    use std::rc::Rc;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;

    #[test]
    fn work_waits_for_the_outermost_batch_and_runs_at_once_without_one() {
        let ran = Rc::new(Cell::new(0));
        let r = Rc::clone(&ran);
        later(move || r.set(r.get() + 1));
        assert_eq!(ran.get(), 1, "no batch: at once");

        let outer = batch();
        let inner = batch();
        let r = Rc::clone(&ran);
        later(move || r.set(r.get() + 10));
        drop(inner);
        assert_eq!(ran.get(), 1, "an inner batch leaves it to the outer");
        let r = Rc::clone(&ran);
        later(move || {
            r.set(r.get() + 100);
            // Queued while the batch's work runs: run at once, not lost.
            let r2 = Rc::clone(&r);
            later(move || r2.set(r2.get() + 1000));
        });
        drop(outer);
        assert_eq!(ran.get(), 1111);
    }

    /// Runs `body` on a thread of its own, handing it a flag to set from its work; whether
    /// the thread panicked, and whether the flag was set.
    fn on_a_thread(body: impl FnOnce(Arc<AtomicBool>) + Send + 'static) -> (bool, bool) {
        let ran = Arc::new(AtomicBool::new(false));
        let r = Arc::clone(&ran);
        let panicked = std::thread::spawn(move || body(r)).join().is_err();
        (panicked, ran.load(Ordering::SeqCst))
    }

    #[test]
    fn work_that_panics_does_not_stop_the_rest() {
        let (panicked, ran) = on_a_thread(|r| {
            let _b = batch();
            later(|| panic!("a hand-over that panics"));
            later(move || r.store(true, Ordering::SeqCst));
        });
        assert!(panicked, "its panic goes on");
        assert!(ran);
    }

    #[test]
    fn a_panic_in_the_batch_still_runs_its_work() {
        let (_, ran) = on_a_thread(|r| {
            let _b = batch();
            later(move || r.store(true, Ordering::SeqCst));
            panic!("a fault handler that panics");
        });
        assert!(ran);
    }
}

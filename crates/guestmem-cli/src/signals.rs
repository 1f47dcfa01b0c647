//! SIGINT and SIGTERM for the commands that must not die half-way: the first asks the
//! work to stop where it can stop cleanly, a second ends the process at once.

use anyhow::Result;

/// SIGINT and SIGTERM blocked in this thread and every thread made after (call it first),
/// and taken by a thread of their own: the first says `first` on stderr and calls
/// `on_first`; a second says the work is ended where it stands (`left`) and ends the
/// process at once, exit status 130.
pub fn watch(
    first: &'static str,
    left: &'static str,
    on_first: impl FnOnce() + Send + 'static,
) -> Result<()> {
    let signals = crate::serve_uffd::block_drain_signals()?;
    std::thread::Builder::new()
        .name("guestmem-signals".into())
        .spawn(move || {
            let mut sig: libc::c_int = 0;
            // SAFETY: `signals` is an initialised sigset; sigwait writes one int.
            if unsafe { libc::sigwait(&signals, &mut sig) } != 0 {
                return;
            }
            // Said on standard error whatever the log's form: the operator who pressed
            // Ctrl-C reads it there.
            eprintln!("guestmem: signal {sig}: {first}; a second signal ends guestmem at once");
            on_first();
            // SAFETY: as above.
            if unsafe { libc::sigwait(&signals, &mut sig) } == 0 {
                eprintln!("guestmem: signal {sig} again: ending now, {left}");
                std::process::exit(130);
            }
        })?;
    Ok(())
}

//! The `guestmem` command: parses flags, builds library objects, prints. All work is in the
//! `guestmem` library.

mod bringup;
mod inspect;
mod man;
mod moves;
mod report;
mod serve_ctl;
mod serve_uffd;
mod signals;
mod snapshot;
mod store;

use std::io::Write;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// Bring up and inspect guest memory the way a VMM would, and serve Firecracker's
/// snapshot restores.
#[derive(Parser)]
#[command(name = "guestmem", version, about)]
pub(crate) struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Map a guest memory layout, populate (and pin) it in parallel, verify and report.
    Bringup(bringup::Args),
    /// Show what the kernel gave a running process's large mappings (a VMM's guest memory).
    Inspect(inspect::Args),
    /// Serve a Firecracker snapshot restore's page faults (its `Uffd` memory backend) from
    /// the memory file: parallel handlers, whole blocks, recorded prefetch.
    ServeUffd(Box<serve_uffd::Args>),
    /// Ask a running page server (its --control socket): status, health, drain, metrics.
    ServeCtl(serve_ctl::Args),
    /// Snapshots in object storage (S3): push, pull, ls, gc.
    Snapshot(snapshot::Args),
    /// Move a running Firecracker VM (restored from a snapshot in the store) to another
    /// host's `guestmem move-in`, with a pause of milliseconds: run on the source host.
    Move(moves::Out),
    /// Take one VM moved here by `guestmem move`, and serve it until it ends: run on the
    /// destination host.
    MoveIn(moves::In),
    /// Write the manual pages (a packaging step).
    #[command(hide = true)]
    Man(man::Args),
}

/// The error and its causes, each cause only if the text so far does not already say it
/// (library errors name their errno in their own message).
fn message(e: &anyhow::Error) -> String {
    let mut text = String::new();
    for cause in e.chain() {
        let c = cause.to_string();
        if text.contains(&c) {
            continue;
        }
        if !text.is_empty() {
            text.push_str(": ");
        }
        text.push_str(&c);
    }
    text
}

fn main() -> ExitCode {
    // A write past a file-size limit (`ulimit -f`) fails with EFBIG instead of killing the
    // process: a page server's frame cache then serves that frame uncached, a pull says
    // which file it could not write.
    // SAFETY: sets one signal's disposition to ignored, before any other thread runs.
    unsafe { libc::signal(libc::SIGXFSZ, libc::SIG_IGN) };
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Bringup(args) => bringup::run(args),
        Command::Inspect(args) => inspect::run(args),
        Command::ServeUffd(args) => serve_uffd::run(*args),
        Command::ServeCtl(args) => serve_ctl::run(args),
        Command::Snapshot(args) => snapshot::run(args),
        Command::Move(args) => moves::run_out(args),
        Command::MoveIn(args) => moves::run_in(args),
        Command::Man(args) => man::run(args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // A closed pipe (`guestmem ... | head`) is not an error worth reporting.
            if e.downcast_ref::<std::io::Error>()
                .is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe)
            {
                return ExitCode::SUCCESS;
            }
            let _ = writeln!(std::io::stderr(), "guestmem: error: {}", message(&e));
            ExitCode::FAILURE
        }
    }
}

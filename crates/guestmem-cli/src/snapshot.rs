//! `guestmem snapshot`: snapshots in object storage: `push`, `pull`, `ls`, `gc`.

use std::io::Write;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::{Args as ClapArgs, Subcommand};
use guestmem::plan::parse_size;
use guestmem::store::{self, Client, PushConfig, PushSource, StoreUrl};

use crate::report::{bytes, write_json};
use crate::store::Stores;

/// Flags of `guestmem snapshot`.
#[derive(ClapArgs)]
pub struct Args {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Push a snapshot to object storage: a guestmem snapshot directory (a chain too), or a
    /// raw memory file (Firecracker's Full; its Diff with --base). Frames the bucket holds
    /// already are not uploaded again; the manifest is written last.
    Push(Push),
    /// Write a snapshot's raw memory file (for Firecracker's File backend), every frame
    /// checked.
    Pull(Pull),
    /// List the snapshots in a bucket (under a name, when given).
    Ls(Ls),
    /// Delete the frames no snapshot names, older than --grace-s; nothing while a push runs.
    Gc(Gc),
}

#[derive(ClapArgs)]
struct Push {
    /// A guestmem snapshot directory, or a raw memory file.
    src: PathBuf,
    /// Where to: s3://BUCKET/NAME (the name must be new).
    url: String,
    /// SRC is a Firecracker Diff memory file (sparse: a hole takes the base's page) on
    /// this snapshot.
    #[arg(long)]
    base: Option<String>,
    /// Push a Diff whose file was there long before Firecracker last wrote it. Firecracker
    /// merges a Diff into a file of the memory's size that is there already, so the pages
    /// that file held before are pushed as changed: only right where they were this VM's
    /// on this base (an earlier diff of it on this base, written to the same path).
    #[arg(long, requires = "base")]
    reused_file: bool,
    /// Bytes per frame: a power of two from 64K to 16M (a diff takes its base's).
    #[arg(long, default_value = "256K", value_parser = size)]
    frame_size: u64,
    /// Frames read, hashed, compressed and uploaded at once.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..=64))]
    threads: u32,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
}

#[derive(ClapArgs)]
struct Pull {
    /// The snapshot: s3://BUCKET/NAME.
    url: String,
    /// The memory file to write (must not exist).
    file: PathBuf,
    /// Frames fetched at once.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..=64))]
    threads: u32,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
}

#[derive(ClapArgs)]
struct Ls {
    /// s3://BUCKET, or s3://BUCKET/PREFIX.
    url: String,
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

#[derive(ClapArgs)]
struct Gc {
    /// s3://BUCKET.
    url: String,
    /// Keep frames younger than this many seconds, named or not (a push in progress may
    /// be about to name them).
    #[arg(long, default_value = "3600", value_parser = clap::value_parser!(u64))]
    grace_s: u64,
    /// Say what would be deleted; delete nothing.
    #[arg(long)]
    dry_run: bool,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
}

/// A stop the first SIGINT or SIGTERM sets (saying `first`); a second ends the process
/// at once, leaving what `left` says ([`crate::signals::watch`]).
fn stop_on_signal(first: &'static str, left: &'static str) -> Result<Arc<AtomicBool>> {
    let stop = Arc::new(AtomicBool::new(false));
    let set = Arc::clone(&stop);
    crate::signals::watch(first, left, move || set.store(true, Ordering::Relaxed))?;
    Ok(stop)
}

fn size(s: &str) -> Result<u64, String> {
    parse_size(s).map_err(|e| e.to_string())
}

/// Runs `guestmem snapshot`.
pub fn run(a: Args) -> Result<()> {
    match a.command {
        Command::Push(p) => push(p),
        Command::Pull(p) => pull(p),
        Command::Ls(l) => ls(l),
        Command::Gc(g) => gc(g),
    }
}

fn push(p: Push) -> Result<()> {
    let url = StoreUrl::parse(&p.url, false)?;
    let source = match &p.base {
        Some(base) => {
            let base = StoreUrl::parse(base, false).context("--base")?;
            if base.bucket != url.bucket {
                bail!(
                    "--base {base}: a diff goes in its base's bucket ({})",
                    url.bucket
                );
            }
            PushSource::RawDiff {
                path: p.src.clone(),
                base,
            }
        }
        None if p.src.is_dir() => PushSource::Guestmem(p.src.clone()),
        None => PushSource::Raw(p.src.clone()),
    };
    // Before the client: its runtime's threads must block the signals too.
    let stop = stop_on_signal(
        "stopping: the push ends once the frames under way are up; nothing is published, its lease is given back",
        "its lease left in the bucket (gc waits until it is 10 minutes old)",
    )?;
    let client = Arc::new(Client::connect(&url.bucket)?);
    let r = store::push(
        &client,
        &source,
        &url,
        &PushConfig {
            frame_bytes: p.frame_size,
            threads: p.threads as usize,
            reused_file_ok: p.reused_file,
            stop: Some(stop),
            ..PushConfig::default()
        },
    )
    .with_context(|| format!("push {} to {url}", p.src.display()))?;
    let mut out = std::io::stdout().lock();
    if p.json {
        return write_json(&mut out, &r);
    }
    writeln!(
        out,
        "pushed {} ({} of memory, {} frames)",
        r.url,
        bytes(r.memory_bytes),
        r.frames
    )?;
    writeln!(
        out,
        "  read {}; stored {} in {} frames ({} compressed); skipped {} frames ({}) already there; {} zero frames, {} from the base",
        bytes(r.bytes_read),
        bytes(r.bytes_stored),
        r.objects_stored,
        r.compressed,
        r.objects_skipped,
        bytes(r.bytes_skipped),
        r.zero_frames,
        r.base_frames
    )?;
    writeln!(
        out,
        "  {:.2} s: read {:.2} s, hash {:.2} s, compress {:.2} s, upload {:.2} s (thread-seconds); manifest {}",
        r.wall_secs,
        r.read_secs,
        r.hash_secs,
        r.compress_secs,
        r.upload_secs,
        bytes(r.manifest_bytes)
    )?;
    Ok(())
}

fn pull(p: Pull) -> Result<()> {
    let mut stores = Stores::new(None, None, Duration::from_secs(30))?;
    let memory = stores.open_memory(&p.url)?;
    let r = store::pull(&memory, &p.file, p.threads as usize)
        .with_context(|| format!("pull {} into {}", p.url, p.file.display()))?;
    let mut out = std::io::stdout().lock();
    if p.json {
        return write_json(&mut out, &r);
    }
    writeln!(
        out,
        "pulled {} into {}: {} of memory, {} frames of data, {} fetched, {:.2} s",
        r.url,
        p.file.display(),
        bytes(r.memory_bytes),
        r.data_frames,
        bytes(r.bytes_fetched),
        r.wall_secs
    )?;
    Ok(())
}

fn ls(l: Ls) -> Result<()> {
    let url = StoreUrl::parse(&l.url, true)?;
    let client = Client::connect(&url.bucket)?;
    client.check()?;
    let list = store::list(&client, &url)?;
    let mut out = std::io::stdout().lock();
    if l.json {
        return write_json(&mut out, &list);
    }
    for s in list {
        writeln!(
            out,
            "{}\t{}\t{} frames of data\t{}{}",
            s.url,
            bytes(s.memory_bytes),
            s.data_frames,
            if s.guestmem { "guestmem" } else { "raw" },
            s.base.map_or(String::new(), |b| format!("\tdiff on {b}"))
        )?;
    }
    Ok(())
}

fn gc(g: Gc) -> Result<()> {
    let url = StoreUrl::parse(&g.url, true)?;
    if !url.name.is_empty() {
        bail!(
            "gc {}: gc takes a whole bucket (s3://{}), where every snapshot shares its frames; \
             a name or prefix would not narrow it",
            g.url,
            url.bucket
        );
    }
    // Before the client: its runtime's threads must block the signals too.
    let stop = stop_on_signal(
        "stopping: gc ends before its next delete, its mark given back",
        "its mark left in the bucket (a push waits until it is 5 minutes old)",
    )?;
    let client = Client::connect(&url.bucket)?;
    client.check()?;
    let r = store::gc(
        &client,
        &url,
        Duration::from_secs(g.grace_s),
        g.dry_run,
        Some(&stop),
    )?;
    let mut out = std::io::stdout().lock();
    if g.json {
        write_json(&mut out, &r)?;
        return stopped_is_an_error(&r);
    }
    writeln!(
        out,
        "{} snapshots; {} frames: {} named, {} younger than the grace, {} {} ({}){}",
        r.snapshots,
        r.frames,
        r.named,
        r.young,
        r.deleted,
        if r.dry_run {
            "would be deleted"
        } else {
            "deleted"
        },
        bytes(r.bytes_deleted),
        match (r.stopped_for_push, r.stopped) {
            (true, _) => "; stopped: a push began",
            (_, true) => "; stopped: asked to",
            _ => "",
        }
    )?;
    stopped_is_an_error(&r)
}

/// A gc asked to stop is not done: its exit status says so (its report said what it did).
fn stopped_is_an_error(r: &store::GcReport) -> Result<()> {
    if r.stopped {
        bail!("gc stopped before it was done, as asked: run it again to finish");
    }
    Ok(())
}

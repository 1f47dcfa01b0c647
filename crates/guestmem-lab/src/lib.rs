//! The guestmem lab: each seed's experiment as a scenario that runs guestmem beside the peers
//! it is measured against, on this machine, and writes what it measured as JSON and Markdown.
//!
//! - [`populate`]: seeds 000/001, bringing up fresh guest memory (map, THP advice, populate)
//!   with guestmem on 1 and N threads, pinned and not, against [`peer_qemu`] and [`peer_ch`].
//! - [`guards`]: seed 003, huge-page coverage of a region with guestmem's guards (outside the
//!   aligned span), without guards, with a TCG-style guard page inside, and unaligned.
//! - [`faults`]: seed 002, page-fault scaling over threads with one VMA or one per thread.
//! - [`translate`]: seed 004, multi-threaded lookups: per-thread cached translators against
//!   a shared binary search (guestmem's snapshot, vm-memory's `find_region`).
//! - [`restore`], [`vm_restore`]: snapshot restores (page servers beside a Firecracker-style
//!   one, mapped and eager; a KVM guest restored every way until it verified every page).
//! - [`huge_regain`]: a restored map on 4 KiB pages against the same map collapsed back to
//!   the transparent huge pages it was saved with: a random-access pass over each.
//! - [`object_store`]: a VM's memory served straight from S3 (a real S3 server behind a
//!   latency and bandwidth proxy) beside a local file; pushes and diffs.
//! - [`fleet`]: many VMs restored at once from one snapshot: one guestmem fleet, a page
//!   server per VM, Firecracker's example handler per VM.
//! - [`firecracker`]: restores of a real Firecracker VM (the shared build and guest): its
//!   File backend and example handlers beside guestmem's page server, 4 KiB and 2 MiB
//!   guests, warm and cold page cache; the test kit's `firecracker::vmm` drives a Firecracker process.
//! - [`vm`]: the guest side of `guestmem-lab vm`: a hand-assembled guest on KVM over guestmem's
//!   memslots, and the `dirty_log_perf_test` engine.
//! - [`report`]: the one result frame every scenario fills ([`LabResult`]), the Markdown
//!   report and the run folder (`result.json`, `report.md`, `plot.svg`).
//! - [`run`]: what every scenario records about the machine and the command, the run folder,
//!   the protocol every scenario measures with (warm-up, interleaved rounds) and the
//!   statistics (median, minimum, maximum) every result is quoted with.
//!
//! Peers are reproduced from the behaviour of the VMMs they stand for (each module's docs say
//! what, and from which source), each in its own module, never tuned to lose. Timings on a VM whose host backs memory lazily are noisy, so
//! scenarios warm up, interleave variants round by round and report spreads and ratios.
#![deny(missing_docs)]

pub mod all;
pub mod error;
pub mod faults;
pub mod firecracker;
pub mod fleet;
pub mod guards;
pub mod huge_regain;
pub mod moves;
pub mod object_store;
pub mod peer;
pub mod peer_ch;
pub mod peer_qemu;
pub mod plot;
pub mod populate;
pub mod report;
pub mod restore;
pub mod run;
pub mod stop;
pub mod translate;
pub mod vm;
pub mod vm_restore;
mod workers;

pub use error::LabError;
pub use faults::{run_faults, FaultsLabConfig, FaultsResult};
pub use guards::{run_guards, GuardsLabConfig, GuardsResult};
pub use peer::PeerError;
pub use populate::{run_populate, LayoutKind, PopulateLabConfig, PopulateResult};
pub use report::{write_run, LabReport, LabResult};
pub use run::{Order, Protocol, RunInfo, Summary};
pub use translate::{run_translate, TranslateLabConfig, TranslateResult};

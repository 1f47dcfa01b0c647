//! How the object-store scenario runs: its settings, recorded with its result.

use std::path::PathBuf;

use crate::run::{available_cpus, Protocol};

/// How to run the scenario (also its recorded settings).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ObjectStoreLabConfig {
    /// Memory, bytes (a multiple of 1 MiB).
    pub size: u64,
    /// Frame size of the push, bytes.
    pub frame_bytes: u64,
    /// The page server's block for the local file, bytes (a snapshot in the store is served
    /// a frame a fault).
    pub block_bytes: u64,
    /// Share of memory in the working set.
    pub ws_fraction: f64,
    /// The working set's runs, bytes.
    pub ws_run: u64,
    /// First-byte latencies of the store, milliseconds.
    pub latencies_ms: Vec<u64>,
    /// The link's bandwidth, bytes a second (0: no cap).
    pub bandwidth: u64,
    /// VMs of the many-VM variant.
    pub vms: usize,
    /// Share of pages a diff rewrites.
    pub diff_fraction: f64,
    /// Fault-serving threads.
    pub pool: usize,
    /// Which variants run (name prefixes; empty: all).
    #[serde(default)]
    pub only: Vec<String>,
    /// The S3 server's threads' nice value (0: it competes for this host's CPUs; 19: it
    /// takes what they spare, as a store on other machines would).
    #[serde(default)]
    pub store_nice: i32,
    /// Scratch folder (removed afterwards).
    pub work_dir: PathBuf,
    /// Warm-up, rounds, order.
    pub protocol: Protocol,
    /// The command line to record.
    #[serde(skip)]
    pub command: String,
    /// THP mode (recorded).
    #[serde(default)]
    pub thp_mode: String,
}

impl Default for ObjectStoreLabConfig {
    fn default() -> Self {
        ObjectStoreLabConfig {
            size: 1 << 30,
            frame_bytes: 256 << 10,
            block_bytes: 1 << 20,
            ws_fraction: 0.10,
            ws_run: 256 << 10,
            latencies_ms: vec![0, 20],
            bandwidth: 1 << 30,
            vms: 20,
            diff_fraction: 0.05,
            pool: available_cpus(),
            only: Vec::new(),
            store_nice: 0,
            work_dir: std::env::temp_dir()
                .join(format!("guestmem-lab-object-store-{}", std::process::id())),
            protocol: Protocol {
                warmup: 1,
                rounds: 3,
                order: crate::run::Order::Rotate,
            },
            command: String::new(),
            thp_mode: String::new(),
        }
    }
}

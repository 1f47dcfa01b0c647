//! What a move run records: each move's pause, its steps and its remote faults, by
//! variant (`result.json`).

use super::MoveLabConfig;
use crate::report::LabResult;
use crate::run::{Sampled, Summary};

fn yes() -> bool {
    true
}

/// One move.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct MoveSample {
    /// The pause, ms: `PATCH /vm Paused` to the VM running on the destination.
    pub pause_ms: f64,
    /// Its steps, ms: pausing, Firecracker's Diff snapshot, the vmstate sent, the chain's
    /// manifest made (while the destination loads the vmstate), the wait from the chain sent
    /// to the VM loaded there, the commit (the destination resumes it). Beside them, on the
    /// destination: the chain opened, and Firecracker's load (the VM paused) from the
    /// vmstate's arrival.
    pub step_pause_ms: f64,
    /// See `step_pause_ms`.
    pub snapshot_ms: f64,
    /// See `step_pause_ms`.
    pub frames_ms: f64,
    /// See `step_pause_ms`.
    pub send_ms: f64,
    /// See `step_pause_ms`.
    #[serde(default)]
    pub wait_ms: f64,
    /// See `step_pause_ms`.
    pub open_ms: f64,
    /// See `step_pause_ms`.
    pub load_ms: f64,
    /// The commit: its message, the destination's resume, its answer, ms.
    pub commit_ms: f64,
    /// Bytes of memory in the diff.
    pub diff_bytes: u64,
    /// Bytes of frames the source sent.
    pub bytes_sent: u64,
    /// The destination's GETs to the source, and their latency, microseconds.
    pub remote_gets: u64,
    /// See `remote_gets`.
    pub remote_p50_us: f64,
    /// See `remote_gets`.
    pub remote_p99_us: f64,
    /// Those a fault sent itself (not read-ahead): count, latency, microseconds.
    pub fault_gets: u64,
    /// See `fault_gets`.
    pub fault_get_p50_us: f64,
    /// See `fault_gets`.
    pub fault_get_p99_us: f64,
    /// The destination's faults on frames the source owed and it did not hold yet: how
    /// many, and how long each waited for its frame (its own GET, or one in flight it
    /// joined), microseconds: quantiles of the waits as measured (nearest rank, over the
    /// latest 4096 of a move); in runs before 2026-11-27 18:00, a histogram bucket's upper
    /// bound (up to 19% above).
    #[serde(default)]
    pub remote_faults: u64,
    /// See `remote_faults`.
    #[serde(default)]
    pub remote_fault_p50_us: f64,
    /// See `remote_faults`.
    #[serde(default)]
    pub remote_fault_p99_us: f64,
    /// The destination's demand faults that brought their block in (engine), microseconds.
    pub miss_p50_us: f64,
    /// See `miss_p50_us`.
    pub miss_p99_us: f64,
    /// The window of risk: the pause to the destination's release, ms.
    pub risk_ms: f64,
    /// The push of the diff to the store, seconds.
    pub push_secs: f64,
    /// The guest's check of every qword on the destination, seconds.
    pub check_secs: f64,
    /// Mismatched qwords it found.
    pub bad: u64,
}

/// A variant's rounds.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct MoveVariant {
    /// `rtt R ms, D MiB`.
    pub name: String,
    /// The round trip added, ms.
    pub rtt_ms: f64,
    /// What the guest wrote, MiB.
    pub dirty_mib: u64,
    /// Whether the destination fetched the source's frames ahead of the guest (runs
    /// before the variant without had it always).
    #[serde(default = "yes")]
    pub read_ahead: bool,
    /// The pause, ms.
    pub pause_ms: Summary,
    /// Every round.
    pub samples: Vec<Sampled<MoveSample>>,
}

/// What the scenario found.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct MoveFindings {
    /// Every variant.
    pub variants: Vec<MoveVariant>,
}

/// The scenario's whole result.
pub type MoveResult = LabResult<MoveLabConfig, MoveFindings>;

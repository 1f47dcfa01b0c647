//! Checks a populate-and-pin request against the host's limits before any memory is touched.
//!
//! Design choice: the checks are a separate step, [`check`], not part of
//! [`crate::populate::populate`]. `populate` is the mechanism and does what it is told, so a
//! test (or a VMM that knows better) can drive it into a real failure to exercise the undo
//! path; [`crate::bringup::bringup`] is the policy and always checks first.
//!
//! The numbers come from [`crate::host`]: this module only tells it what each region already
//! has (resident and locked bytes, read from smaps once), so memory brought up before, or
//! locked before, is not asked for twice.

use crate::host::{Demand, Host, HostError, Needs, Stage};
use crate::inspect::{self, InspectError, RegionUsage};
use crate::map::MapView;

use crate::populate::PinStrategy;
use crate::region::Region;

/// Why a request exceeds the host's limits, or the limits could not be read.
#[derive(Debug, thiserror::Error)]
pub enum LimitError {
    /// The request does not fit the host.
    #[error(transparent)]
    Host(#[from] HostError),
    /// The kernel's account of the regions could not be read.
    #[error(transparent)]
    Inspect(#[from] InspectError),
}

/// What `region` still asks of the host, given what the kernel says it has.
fn demand(region: &Region, usage: &RegionUsage) -> Demand {
    Demand {
        guest_addr: region.guest_addr().0,
        size: region.size(),
        hugetlb: match region.backing() {
            crate::layout::Backing::Hugetlb(h) => Some(*h),
            _ => None,
        },
        reserve: region.reserve(),
        mappings: 0,
        resident: usage.resident,
        locked: usage.locked,
        numa_node: region.numa_node(),
    }
}

/// Checks pinning (by `pin`) and populating every region of `snap` against the host's limits:
/// memory not yet resident against `MemAvailable` and the memory cgroup, `MAP_NORESERVE`
/// hugetlb pages against their pools, and locked memory against `RLIMIT_MEMLOCK`.
pub fn check(snap: &MapView, pin: PinStrategy) -> Result<Needs, LimitError> {
    check_regions(snap.regions(), pin, &Host::read())
}

/// [`check`] for some of a snapshot's regions (what one populate selects), against facts
/// already read.
pub fn check_regions(
    regions: &[std::sync::Arc<Region>],
    pin: PinStrategy,
    host: &Host,
) -> Result<Needs, LimitError> {
    let usage = inspect::inspect_regions(regions)?;
    let demands: Vec<Demand> = regions
        .iter()
        .zip(&usage)
        .map(|(r, u)| demand(r, u))
        .collect();
    let stage = Stage::Populate {
        pin: pin != PinStrategy::None,
    };
    Ok(host.check(&demands, stage)?)
}

//! The touch fallback: populating memory by writing through `/proc/self/mem`, for kernels
//! without `MADV_POPULATE_WRITE` and for memory where a CPU store could raise `SIGBUS` (the
//! kernel's access fails with `EIO` instead).

use super::{fail, ChunkError, TOUCH_PAGEMAP_BATCH_BYTES};
use crate::layout::Backing;
use crate::mmap::ProcMem;
use crate::region::Region;
use crate::sys;

/// Faults in every page of `offset..offset+len` of `region` that is not mapped yet, by
/// writing through `/proc/self/mem`. Pages `/proc/self/pagemap` shows present are skipped:
/// they need no fault, and leaving them alone keeps memory in use untouched.
pub(super) fn touch(
    mem: &ProcMem,
    region: &Region,
    offset: usize,
    len: usize,
) -> Result<(), ChunkError> {
    let mapping = region.mapping();
    let page = region.page_size() as usize;
    let base = sys::base_page_size() as usize;
    let private_anon = matches!(region.backing(), Backing::Anonymous);
    let end = offset + len;
    let mut at = offset;
    while at < end {
        let batch = TOUCH_PAGEMAP_BATCH_BYTES.min(end - at);
        let faulted = mem
            .faulted_in(mapping, at, batch)
            .map_err(fail("read /proc/self/pagemap"))?;
        for p in (0..batch).step_by(page) {
            if faulted[p / base] {
                continue;
            }
            // A private anonymous page never faulted in reads as zero, and reading it would
            // map the (huge) zero page, which the write would then split: write zero.
            let byte = if private_anon {
                0
            } else {
                mem.read_byte(mapping, at + p)
                    .map_err(fail("read via /proc/self/mem"))?
            };
            mem.write_byte(mapping, at + p, byte)
                .map_err(fail("write via /proc/self/mem"))?;
        }
        at += batch;
    }
    Ok(())
}

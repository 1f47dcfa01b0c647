//! KVM's dirty log, read into reused buffers.
//!
//! kvm-ioctls' `get_dirty_log` allocates a fresh `Vec` on every call and has no wrapper for
//! `KVM_CLEAR_DIRTY_LOG`; with 64 slots and a pass every few hundred milliseconds that is 64
//! allocations per pass for nothing. [`SlotLog`] keeps one buffer per slot, sized once from
//! the slot's own page count, and bound to that slot's number: the two wrappers here fill
//! and clear that slot from it, and nothing else can be passed. Crate-private: only the
//! memslot that knows its size makes one.

use std::os::fd::AsRawFd;

use kvm_bindings::{
    kvm_clear_dirty_log, kvm_clear_dirty_log__bindgen_ty_1, kvm_dirty_log,
    kvm_dirty_log__bindgen_ty_1, KVMIO,
};
use vmm_sys_util::ioctl::{ioctl_with_mut_ref, ioctl_with_ref};
use vmm_sys_util::{ioctl_iow_nr, ioctl_iowr_nr};

use super::KvmError;

/// The request numbers kvm-ioctls does not export, as in `linux/kvm.h`.
mod nr {
    use super::*;
    ioctl_iow_nr!(KVM_GET_DIRTY_LOG, KVMIO, 0x42, kvm_dirty_log);
    ioctl_iowr_nr!(KVM_CLEAR_DIRTY_LOG, KVMIO, 0xc0, kvm_clear_dirty_log);
}
use nr::{KVM_CLEAR_DIRTY_LOG, KVM_GET_DIRTY_LOG};

/// One slot's dirty-log buffer: one bit per page, in 64-bit words, reused across harvests.
#[derive(Debug, Clone)]
pub(crate) struct SlotLog {
    slot: u32,
    words: Vec<u64>,
    pages: u64,
}

impl SlotLog {
    /// A buffer for slot `slot` of `pages` pages.
    pub(crate) fn new(slot: u32, pages: u64) -> SlotLog {
        SlotLog {
            slot,
            words: vec![0; pages.div_ceil(64) as usize],
            pages,
        }
    }

    /// The words the last [`SlotLog::get`] filled.
    pub(crate) fn words(&self) -> &[u64] {
        &self.words
    }

    /// `KVM_GET_DIRTY_LOG` for this buffer's slot. Without manual protection KVM also
    /// clears its log and write-protects the pages; with it, call [`SlotLog::clear`] after.
    pub(crate) fn get(&mut self, vm: &impl AsRawFd) -> Result<(), KvmError> {
        let log = kvm_dirty_log {
            slot: self.slot,
            padding1: 0,
            __bindgen_anon_1: kvm_dirty_log__bindgen_ty_1 {
                dirty_bitmap: self.words.as_mut_ptr().cast(),
            },
        };
        // SAFETY: `words` holds one bit per page of slot `self.slot` (sized in `new` from that
        // slot by the memslot that made it, the only caller), all KVM writes; &mut self: no
        // other reference to the buffer, which outlives the call.
        let ret = unsafe { ioctl_with_ref(vm, KVM_GET_DIRTY_LOG(), &log) };
        if ret < 0 {
            return Err(KvmError::Ioctl {
                op: "KVM_GET_DIRTY_LOG",
                source: std::io::Error::last_os_error(),
            });
        }
        Ok(())
    }

    /// `KVM_CLEAR_DIRTY_LOG` for `slot` with this buffer: re-protects exactly the pages the
    /// last [`SlotLog::get`] reported (needs manual protection enabled). Skipped when the
    /// buffer is clean.
    pub(crate) fn clear(&mut self, vm: &impl AsRawFd) -> Result<(), KvmError> {
        if self.words.iter().all(|&w| w == 0) {
            return Ok(());
        }
        let mut clear = kvm_clear_dirty_log {
            slot: self.slot,
            // The whole slot: first_page 0 (a multiple of 64) and num_pages reaching the
            // slot's end, the two alignment rules the kernel enforces.
            num_pages: u32::try_from(self.pages).map_err(|_| KvmError::Ioctl {
                op: "KVM_CLEAR_DIRTY_LOG",
                source: std::io::Error::from(std::io::ErrorKind::InvalidInput),
            })?,
            first_page: 0,
            __bindgen_anon_1: kvm_clear_dirty_log__bindgen_ty_1 {
                dirty_bitmap: self.words.as_mut_ptr().cast(),
            },
        };
        // SAFETY: the kernel reads num_pages bits from `words`, which holds
        // ceil(pages / 64) words (sized in `new`); the buffer outlives the call.
        let ret = unsafe { ioctl_with_mut_ref(vm, KVM_CLEAR_DIRTY_LOG(), &mut clear) };
        if ret < 0 {
            return Err(KvmError::Ioctl {
                op: "KVM_CLEAR_DIRTY_LOG",
                source: std::io::Error::last_os_error(),
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slot_log_sizes_one_bit_per_page() {
        assert_eq!(SlotLog::new(0, 1).words().len(), 1);
        assert_eq!(SlotLog::new(0, 64).words().len(), 1);
        assert_eq!(SlotLog::new(0, 65).words().len(), 2);
        assert_eq!(SlotLog::new(0, 0).words().len(), 0);
    }

    #[test]
    fn ioctl_numbers_match_the_kernel_abi() {
        // _IOW(KVMIO, 0x42, struct kvm_dirty_log) and _IOWR(KVMIO, 0xc0, struct
        // kvm_clear_dirty_log), both 16/24-byte structs, as in linux/kvm.h.
        assert_eq!(KVM_GET_DIRTY_LOG(), 0x4010_ae42);
        assert_eq!(KVM_CLEAR_DIRTY_LOG(), 0xc018_aec0);
    }
}

//! An image of memory read from elsewhere than a file of this host (a snapshot in object
//! storage): its blocks planned from what the source holds, read through the source.

use std::collections::BTreeMap;
use std::fs::File;
use std::path::PathBuf;
use std::sync::Arc;

use super::{Image, ImageRegion, Inner, Layer, Plan};
use crate::snapshot::{Manifest, SnapshotError};

/// Why blocks are asked for ahead.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Ahead {
    /// A recorded working set, asked for whole as a restore starts: the VM reads these
    /// next, in this order. Their GETs do not hold back for a fault's own (which waits on
    /// them: the fault is the VM come to where they have not reached yet).
    Wanted,
    /// A guess (a window past a fault, the prefetch's order): held back while a fault
    /// fetches a frame of its own.
    Guessed,
}

/// Memory an image reads from somewhere other than a file of this host (a snapshot in object
/// storage): offsets are the memory's own (as a raw memory file's).
// Only object storage (the `store` feature) makes such images.
#[cfg_attr(not(feature = "store"), allow(dead_code))]
pub(crate) trait RemoteMemory: Send + Sync + std::fmt::Debug {
    /// Reads `dst.len()` bytes at `offset`, every byte checked (retried as its source allows).
    fn read(
        &self,
        offset: u64,
        dst: &mut [u8],
    ) -> Result<(), std::sync::Arc<dyn std::error::Error + Send + Sync>>;
    /// Whether `offset..offset + len` holds any data (else it reads as zero).
    fn held(&self, offset: u64, len: u64) -> bool;
    /// `ranges` will be read soon, in this order: fetch them ahead, in the background.
    fn ahead(&self, ranges: &[(u64, u64)], why: Ahead);
    /// `ranges` will be installed next, in this order: read what is at hand (a frame the
    /// host's cache holds) into memory, checked, on another thread.
    fn stage(&self, ranges: &[(u64, u64)]);
    /// `len` bytes at `offset` if they were read ahead into memory, checked (a whole frame
    /// read-ahead staged): taken, so that they are installed straight from there. No read.
    fn take_ready(&self, offset: u64, len: u64) -> Option<Arc<Vec<u8>>>;
    /// Bytes `take_ready` gave, installed: their buffer may be read into again.
    fn give_back(&self, bytes: Arc<Vec<u8>>);
    /// Where it is read from, for messages.
    fn name(&self) -> String;
}

#[cfg_attr(not(feature = "store"), allow(dead_code))]
impl Image {
    /// Memory read from `memory` (a snapshot in object storage), as an image of `regions`
    /// (where each lies in that memory; a guestmem image's own, or a VM's as its peer
    /// declared them), blocks of `block_bytes` cut within each region. Blocks holding no
    /// data read as zero without a read; every other block is read through `memory`, which
    /// checks what it reads. `name` names it in errors.
    pub(crate) fn remote(
        memory: Arc<dyn RemoteMemory>,
        name: &str,
        regions: Vec<crate::snapshot::ManifestRegion>,
        block_bytes: u64,
        working_set: Vec<u64>,
    ) -> Result<Image, SnapshotError> {
        let mut iregions = Vec::with_capacity(regions.len());
        let mut plan = Plan::whole();
        let mut first_block = 0u64;
        for r in &regions {
            let blocks = r.size.div_ceil(block_bytes);
            for b in 0..blocks {
                let at = b * block_bytes;
                if memory.held(r.file_offset + at, block_bytes.min(r.size - at)) {
                    plan.hold(first_block + b);
                }
            }
            iregions.push(ImageRegion {
                guest_addr: r.guest_addr,
                size: r.size,
                file_offset: r.file_offset,
                page_size: r.page_size,
                backing: r.backing.clone(),
                huge_bytes: r.huge_bytes,
                first_block,
            });
            first_block += blocks;
        }
        // No file of this host holds it: the layer's descriptor is an empty memfd, which
        // nothing reads (reads go through `memory`; a mapped restore needs a file, and an
        // image of remote memory is never mapped).
        let placeholder =
            crate::sys::memfd_create(c"guestmem-remote", libc::MFD_CLOEXEC).map_err(|source| {
                SnapshotError::File {
                    op: "make a placeholder (memfd) for",
                    path: PathBuf::from(name),
                    source,
                }
            })?;
        let manifest = Manifest {
            format: crate::snapshot::FORMAT.into(),
            version: crate::snapshot::VERSION,
            id: name.into(),
            parent: None,
            memory_file: name.into(),
            memory_bytes: regions.iter().map(|r| r.size).sum(),
            block_bytes,
            regions,
            blocks: Vec::new(),
            working_set,
            meta: BTreeMap::new(),
        };
        Ok(Image {
            inner: Arc::new(Inner {
                layers: vec![Layer {
                    dir: PathBuf::from(name),
                    path: PathBuf::from(name),
                    file: File::from(placeholder),
                    manifest,
                }],
                regions: iregions,
                block_bytes,
                plan,
                total_blocks: first_block,
                checked: false,
                source: None,
                remote: Some(memory),
            }),
        })
    }

    /// Whether its memory is read from elsewhere than this host (see [`Image::remote`]).
    pub fn is_remote(&self) -> bool {
        self.inner.remote.is_some()
    }

    /// The bytes of `block` if its remote source has them in memory already, read and
    /// checked (see [`RemoteMemory::take_ready`]); `None` for a local image.
    pub(crate) fn ready_block(&self, block: u64) -> Option<Arc<Vec<u8>>> {
        let remote = self.inner.remote.as_ref()?;
        if !self.held_from(block, 0) {
            return None;
        }
        let (ri, offset, len) = self.block_span(block);
        let bytes = remote.take_ready(self.inner.regions[ri].file_offset + offset, len)?;
        (bytes.len() as u64 == len).then_some(bytes)
    }

    /// Gives back what [`Image::ready_block`] gave, once installed.
    pub(crate) fn give_back(&self, bytes: Arc<Vec<u8>>) {
        if let Some(remote) = &self.inner.remote {
            remote.give_back(bytes);
        }
    }

    /// Tells a remote image's source that `blocks` will be read soon, in this order (a
    /// local image ignores it).
    pub(crate) fn ahead(&self, blocks: impl Iterator<Item = u64>, why: Ahead) {
        if let Some(remote) = &self.inner.remote {
            let ranges = self.ranges_of(blocks);
            if !ranges.is_empty() {
                remote.ahead(&ranges, why);
            }
        }
    }

    /// Tells a remote image's source that `blocks` will be installed next, in this order
    /// (see [`RemoteMemory::stage`]; a local image ignores it).
    pub(crate) fn stage(&self, blocks: impl Iterator<Item = u64>) {
        if let Some(remote) = &self.inner.remote {
            let ranges = self.ranges_of(blocks);
            if !ranges.is_empty() {
                remote.stage(&ranges);
            }
        }
    }

    /// Where those of `blocks` that hold data lie in the image's memory.
    fn ranges_of(&self, blocks: impl Iterator<Item = u64>) -> Vec<(u64, u64)> {
        blocks
            .filter(|&b| b < self.inner.total_blocks && self.held_from(b, 0))
            .map(|b| {
                let (ri, offset, len) = self.block_span(b);
                (self.inner.regions[ri].file_offset + offset, len)
            })
            .collect()
    }
}

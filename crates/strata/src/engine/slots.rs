//! Equal-size slots of device memory for the buffers offload moves (the parameters and
//! gradients of units whose states live on the host). One pool, sized by the plan, holds
//! every such copy; a buffer takes whole slots, any free ones, mapped side by side into an
//! address range the buffer keeps for its lifetime. A buffer larger than a slot (an
//! embedding, a head) is so split into slot-size pieces, its tensors stay contiguous views,
//! and a freed buffer never leaves a hole too small for the next: the pool cannot fragment.
//!
//! Slots are mapped where the device is the CPU; a CUDA device's copies take allocations
//! of libtorch's caching allocator, one per buffer, until slots are mapped there through the
//! driver's virtual memory.
//!
//! Owns the pool's memory and the buffers' address ranges; must not decide which buffer is
//! mapped when (that is [`super::offload`]'s, from the plan) nor count bytes in the ledger.
use super::memory;
use crate::{Error, Result};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use tch::{Device, Tensor};

/// At most this many pieces make the largest buffer: each piece is one mapping call per
/// copy to the device, so the slot grows with the largest buffer.
const MOST_PIECES: u64 = 64;

/// At most this many slot sizes are tried (large models step through coarser multiples).
const SIZES_TRIED: u64 = 4096;

/// The size of a slot, a multiple of `granularity` (the smallest mappable piece), for
/// buffers of `sizes` bytes: of the sizes that split the largest buffer into at most
/// `MOST_PIECES` pieces, the one that wastes the fewest bytes in the last slot of each
/// buffer (the larger slot where two waste alike). Computed from sizes alone.
pub fn choose_slot_bytes(sizes: &[u64], granularity: u64) -> u64 {
    let granularity = granularity.max(1);
    let largest = sizes.iter().copied().max().unwrap_or(0).max(1);
    let lowest = largest.div_ceil(MOST_PIECES).next_multiple_of(granularity);
    let highest = largest.next_multiple_of(granularity);
    let step = granularity * ((highest - lowest) / granularity).div_ceil(SIZES_TRIED).max(1);
    let waste = |slot: u64| sizes.iter().map(|&b| b.next_multiple_of(slot) - b).sum::<u64>();
    let mut candidates: Vec<u64> = (lowest..=highest).step_by(step as usize).collect();
    candidates.push(highest);
    candidates.into_iter().min_by_key(|&slot| (waste(slot), std::cmp::Reverse(slot))).unwrap_or(highest)
}

/// The smallest piece of memory the pool can map: a page.
pub fn granularity() -> u64 {
    // SAFETY: a plain query.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    u64::try_from(page).ok().filter(|&p| p > 0).unwrap_or(4096)
}

fn os_error(what: &str) -> Error {
    Error::Engine(format!("slot pool: {what}: {}", std::io::Error::last_os_error()))
}

/// A fresh range of `len` bytes of addresses that hold nothing (any access faults).
fn reserve(len: usize) -> Result<usize> {
    let flags = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE;
    // SAFETY: a new mapping chosen by the kernel; nothing else is touched.
    let p = unsafe { libc::mmap(std::ptr::null_mut(), len, libc::PROT_NONE, flags, -1, 0) };
    if p == libc::MAP_FAILED {
        return Err(os_error(&format!("cannot reserve {len} bytes of addresses")));
    }
    Ok(p as usize)
}

/// Empties `len` bytes of a reserved range at `at`, whatever was mapped there.
///
/// # Safety
/// `at..at + len` lies within a range [`reserve`] made and nothing reads or writes it.
unsafe fn clear(at: usize, len: usize) -> Result<()> {
    let flags = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE | libc::MAP_FIXED;
    // SAFETY: the caller's contract; MAP_FIXED replaces only this range.
    let p = unsafe { libc::mmap(at as *mut libc::c_void, len, libc::PROT_NONE, flags, -1, 0) };
    if p == libc::MAP_FAILED {
        return Err(os_error(&format!("cannot clear {len} bytes of a buffer's range")));
    }
    Ok(())
}

/// Where the pool's memory comes from.
enum Memory {
    /// One shared memory file whose pages the kernel gives on first use; slots are mapped
    /// into each buffer's range.
    File(OwnedFd),
    /// The device's allocator: a mapped buffer takes an allocation of its own, in one piece.
    Allocator,
}

/// A pool of `capacity` slots of `slot_bytes` each.
pub struct SlotPool {
    slot_bytes: u64,
    memory: Memory,
    /// Free slots; taken from the end.
    free: Vec<u32>,
    capacity: u32,
    /// Bytes mapped now, counted in the CPU allocator's statistics where `counted`.
    mapped: u64,
    counted: bool,
}

/// A buffer whose memory comes from a [`SlotPool`]: an address range of whole slots,
/// mapped while the buffer holds data and empty otherwise.
pub struct SlottedBuffer {
    tensor: Tensor,
    base: usize,
    pieces: usize,
    mapped: bool,
    /// The pool's slots mapped into the range, in order; empty while unmapped.
    slots: Vec<u32>,
}

impl SlottedBuffer {
    /// Whether the buffer's range is mapped, so that it holds data.
    pub fn is_mapped(&self) -> bool {
        self.mapped
    }

    /// Bytes of pool the buffer takes while mapped.
    pub fn slot_bytes_held(&self, pool: &SlotPool) -> u64 {
        self.pieces as u64 * pool.slot_bytes
    }
}

impl SlotPool {
    /// The pool for copies on `device`: `capacity` slots of `slot_bytes` where slots are
    /// mapped (the CPU), the device's allocator elsewhere.
    pub fn on(device: Device, slot_bytes: u64, capacity: u32) -> Result<SlotPool> {
        if SlotPool::maps_slots(device) {
            return SlotPool::new(slot_bytes, capacity);
        }
        Ok(SlotPool { slot_bytes: 1, memory: Memory::Allocator, free: vec![], capacity: 0, mapped: 0, counted: false })
    }

    /// Whether copies on `device` take whole slots.
    pub fn maps_slots(device: Device) -> bool {
        device == Device::Cpu
    }

    /// A pool of `capacity` slots of `slot_bytes`, a multiple of [`granularity`], mapped
    /// from a shared memory file.
    pub fn new(slot_bytes: u64, capacity: u32) -> Result<SlotPool> {
        if slot_bytes == 0 || !slot_bytes.is_multiple_of(granularity()) {
            return Err(Error::Config(format!(
                "slot size {slot_bytes} bytes: it must be a positive multiple of the page size, {}",
                granularity()
            )));
        }
        let len = slot_bytes.checked_mul(capacity as u64).ok_or_else(|| Error::Config("slot pool too large".into()))?;
        // SAFETY: a plain system call; the descriptor is owned from here on.
        let fd = unsafe { libc::memfd_create(c"strata-slots".as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            return Err(os_error("cannot create the pool's memory"));
        }
        // SAFETY: `fd` is a fresh descriptor nothing else owns.
        let memory = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: the descriptor is ours; the kernel checks the size.
        if unsafe { libc::ftruncate(memory.as_raw_fd(), len as libc::off_t) } != 0 {
            return Err(os_error(&format!("cannot size the pool to {len} bytes")));
        }
        Ok(SlotPool {
            slot_bytes,
            memory: Memory::File(memory),
            free: (0..capacity).rev().collect(),
            capacity,
            mapped: 0,
            counted: strata_ext::cpu_memory::stats().is_ok(),
        })
    }

    /// Slots no buffer holds now (none where the device's allocator serves the copies).
    pub fn free_slots(&self) -> usize {
        self.free.len()
    }

    /// Slots of this pool a buffer of `bytes` takes.
    pub fn pieces(&self, bytes: u64) -> u64 {
        bytes.div_ceil(self.slot_bytes)
    }

    /// Moves `t`'s storage (a unit's flat buffer, spanning it whole) into an address range
    /// of its own, unmapped: what the storage held is freed and its contents are lost.
    ///
    /// # Safety
    /// Nothing may read or write a view of `t` until [`SlotPool::map`] maps the buffer
    /// and it is filled, nor while it is unmapped again.
    pub unsafe fn adopt(&self, t: &Tensor) -> Result<SlottedBuffer> {
        let bytes = memory::tensor_bytes(t);
        if let Memory::Allocator = self.memory {
            // SAFETY: the caller's contract.
            unsafe { memory::release_buffer(t) }?;
            return Ok(SlottedBuffer {
                tensor: t.shallow_clone(),
                base: 0,
                pieces: bytes as usize,
                mapped: false,
                slots: vec![],
            });
        }
        let pieces = self.pieces(bytes).max(1) as usize;
        let len = pieces * self.slot_bytes as usize;
        let base = reserve(len)?;
        let release = Box::new(move || {
            // SAFETY: the storage that used the range is gone.
            unsafe { libc::munmap(base as *mut libc::c_void, len) };
        });
        // SAFETY: the range lives until `release`; the caller's contract keeps views away
        // from it while it is empty.
        unsafe { strata_ext::adopt_storage(t, base as *mut libc::c_void, 0, release) }?;
        Ok(SlottedBuffer { tensor: t.shallow_clone(), base, pieces, mapped: false, slots: vec![] })
    }

    /// Maps free slots into `buffer`'s range, holding what they last held (the caller fills
    /// them). Fails, with the counts, when too few are free.
    pub fn map(&mut self, buffer: &mut SlottedBuffer) -> Result<()> {
        if buffer.is_mapped() {
            return Ok(());
        }
        let Memory::File(file) = &self.memory else {
            // SAFETY: the buffer spans its storage; the caller fills it before any use.
            unsafe { memory::restore_buffer(&buffer.tensor) }?;
            buffer.mapped = true;
            return Ok(());
        };
        if self.free.len() < buffer.pieces {
            return Err(Error::Engine(format!(
                "slot pool: a buffer needs {} slots of {} bytes, {} of {} are free",
                buffer.pieces,
                self.slot_bytes,
                self.free.len(),
                self.capacity
            )));
        }
        let slot = self.slot_bytes as usize;
        let taken = self.free.split_off(self.free.len() - buffer.pieces);
        for (piece, &index) in taken.iter().rev().enumerate() {
            let at = buffer.base + piece * slot;
            let flags = libc::MAP_SHARED | libc::MAP_FIXED;
            let offset = (index as u64 * self.slot_bytes) as libc::off_t;
            let prot = libc::PROT_READ | libc::PROT_WRITE;
            // SAFETY: `at` lies in the buffer's reserved range, which nothing uses while it
            // is unmapped; the slot is free, so no other buffer maps it.
            let p = unsafe { libc::mmap(at as *mut libc::c_void, slot, prot, flags, file.as_raw_fd(), offset) };
            if p == libc::MAP_FAILED {
                let e = os_error(&format!("cannot map slot {index}"));
                // SAFETY: as above; the pieces mapped so far are cleared again.
                let _ = unsafe { clear(buffer.base, piece * slot) };
                self.free.extend(taken);
                return Err(e);
            }
        }
        buffer.slots = taken.into_iter().rev().collect();
        buffer.mapped = true;
        self.account(buffer, true)
    }

    /// Returns `buffer`'s slots to the pool; its range is empty again.
    ///
    /// # Safety
    /// Nothing reads or writes a view of the buffer (no operation in flight either) until
    /// it is mapped again.
    pub unsafe fn unmap(&mut self, buffer: &mut SlottedBuffer) -> Result<()> {
        if !buffer.is_mapped() {
            return Ok(());
        }
        buffer.mapped = false;
        if let Memory::Allocator = self.memory {
            // SAFETY: the caller's contract.
            return unsafe { memory::release_buffer(&buffer.tensor) };
        }
        // SAFETY: the caller's contract.
        unsafe { clear(buffer.base, buffer.pieces * self.slot_bytes as usize) }?;
        self.free.append(&mut buffer.slots);
        self.account(buffer, false)
    }

    /// The storage's byte count and the allocator's statistics follow a (un)mapping.
    fn account(&mut self, buffer: &SlottedBuffer, mapped: bool) -> Result<()> {
        let bytes = buffer.slot_bytes_held(self);
        // SAFETY: while mapped the range holds these bytes; while unmapped the storage
        // claims none.
        unsafe { strata_ext::set_storage_nbytes(&buffer.tensor, if mapped { bytes as usize } else { 0 }) }?;
        let signed = if mapped { bytes as i64 } else { -(bytes as i64) };
        self.mapped = self.mapped.saturating_add_signed(signed);
        if self.counted {
            strata_ext::cpu_memory::account(signed)?;
        }
        Ok(())
    }
}

impl Drop for SlotPool {
    fn drop(&mut self) {
        // What is still mapped leaves the statistics with the pool.
        if self.counted && self.mapped > 0 {
            let _ = strata_ext::cpu_memory::account(-(self.mapped as i64));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::with_seed;
    use proptest::prelude::*;
    use tch::Kind;

    proptest! {
        #[test]
        fn the_chosen_slot_wastes_no_more_than_any_other_allowed_size(
            sizes in proptest::collection::vec(1u64..3_000_000, 1..12),
            pages in 1u64..4,
        ) {
            let granularity = 4096 * pages;
            let slot = choose_slot_bytes(&sizes, granularity);
            let largest = *sizes.iter().max().unwrap();
            prop_assert_eq!(slot % granularity, 0);
            prop_assert!(largest.div_ceil(slot) <= MOST_PIECES, "{} pieces", largest.div_ceil(slot));
            let waste = |s: u64| sizes.iter().map(|&b| b.next_multiple_of(s) - b).sum::<u64>();
            // Every allowed size, one granule apart (the search tries them all below its
            // limit of sizes).
            let lowest = largest.div_ceil(MOST_PIECES).next_multiple_of(granularity);
            let mut other = lowest;
            while other <= largest.next_multiple_of(granularity) {
                prop_assert!(waste(slot) <= waste(other), "{slot} wastes {}, {other} {}", waste(slot), waste(other));
                other += granularity;
            }
        }
    }

    #[test]
    fn a_slot_size_that_divides_every_buffer_wastes_nothing() {
        let mib = 1 << 20;
        // Blocks of 24 MiB and an embedding of 96 MiB: 2 MiB granules, at most 64 pieces.
        let slot = choose_slot_bytes(&[24 * mib, 24 * mib, 96 * mib, 24 * mib], 2 * mib);
        assert_eq!(slot, 24 * mib, "the largest slot that wastes nothing");
        assert_eq!(choose_slot_bytes(&[10 * mib + 1], 2 * mib), 12 * mib, "one piece wastes least");
    }

    /// A buffer of `numel` fp32 elements counting from `first`.
    fn counting(first: f64, numel: i64) -> Tensor {
        Tensor::arange(numel, (Kind::Float, Device::Cpu)) + first
    }

    #[test]
    fn buffers_larger_than_a_slot_map_into_scattered_slots_and_keep_their_values() {
        let slot = granularity();
        let per_slot = (slot / 4) as i64;
        // Capacity for 5 slots: a 2-slot and a 1-slot buffer, then, with the 2-slot one
        // returned, a 3-slot buffer must take slots that are not side by side.
        let mut pool = SlotPool::new(slot, 5).unwrap();
        let sizes = [2 * per_slot - 7, per_slot, 3 * per_slot];
        let tensors: Vec<Tensor> = sizes.iter().map(|&n| counting(0.0, n)).collect();
        let views: Vec<Tensor> = tensors.iter().map(|t| t.narrow(0, 1, t.numel() as i64 - 2)).collect();
        let mut buffers: Vec<SlottedBuffer> = tensors.iter().map(|t| unsafe { pool.adopt(t) }.unwrap()).collect();
        assert_eq!(strata_ext::storage_nbytes(&tensors[0]).unwrap(), 0, "an unmapped buffer holds nothing");
        for (i, buffer) in buffers.iter_mut().enumerate().take(2) {
            pool.map(buffer).unwrap();
            let _ = tensors[i].shallow_clone().fill_(i as f64);
        }
        assert_eq!(pool.free_slots(), 2);
        let err = pool.map(&mut buffers[2]).unwrap_err().to_string();
        assert!(err.contains("needs 3 slots") && err.contains("2 of 5 are free"), "{err}");
        unsafe { pool.unmap(&mut buffers[0]) }.unwrap();
        pool.map(&mut buffers[2]).unwrap();
        let slots = buffers[2].slots.clone();
        assert!(slots.windows(2).any(|w| w[1] != w[0] + 1), "scattered slots: {slots:?}");
        let values = with_seed(7, || Tensor::randn([sizes[2]], (Kind::Float, Device::Cpu)));
        tensors[2].shallow_clone().copy_(&values);
        // Read back through a view made before the buffer moved into the pool.
        assert!(views[2].equal(&values.narrow(0, 1, sizes[2] - 2)));
        assert_eq!(views[1].sum(Kind::Double).double_value(&[]), (per_slot - 2) as f64, "untouched");
        assert_eq!(strata_ext::storage_nbytes(&tensors[2]).unwrap() as u64, 3 * slot);
        assert_eq!(pool.free_slots(), 1);
        unsafe { pool.unmap(&mut buffers[1]) }.unwrap();
        assert_eq!(pool.free_slots(), 2, "an unmapped buffer's slot returns to the pool");
        assert_eq!(strata_ext::storage_nbytes(&tensors[1]).unwrap(), 0);
    }

    #[test]
    fn slot_sizes_off_the_page_are_refused() {
        let err = SlotPool::new(granularity() + 1, 1).err().expect("refused").to_string();
        assert!(err.contains("multiple of the page size"), "{err}");
    }
}

// torch's CPU allocator with a bounded cache of freed large blocks (runtime/block_cache.py builds
// and loads it).
//
// Why: torch's default CPU allocator hands every tensor to malloc. Within a training step glibc
// would reuse freed activations from its arenas, but their holes fragment the heap by ~1 GB, so a
// step maps each block of 256 KB or more on its own (runtime/memory.py) and every page of it
// faults again on first touch: a third of a demo step's user time went to the kernel. Here a
// freed block of `threshold` bytes or more keeps its pages and is handed to the next allocation
// that fits in it (cut to size when much larger), as CUDA's caching allocator does; no heap lies
// around it to fragment. A miss unmaps cached blocks before it maps, so the cache raises the
// process's peak by `slack` bytes at most. At most `limit` bytes wait in the cache (a freed block that would pass it
// is unmapped at once), and release() unmaps them all, between the phases of a run. Smaller
// blocks go to the allocator that was in place before, unchanged, and so do all blocks while the
// cache is not active (set_active: the library turns it on for training steps and the
// generator's forwards).

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>
#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <iterator>
#include <map>
#include <mutex>
#include <unordered_map>
#include <utility>
#include <vector>

namespace {

constexpr size_t kPageBytes = 4096;

class BlockCache final : public c10::Allocator {
 public:
  BlockCache(c10::Allocator* smaller, size_t threshold, size_t limit, size_t slack, bool huge_pages)
      : smaller_(smaller), threshold_(threshold), limit_(limit), slack_(slack), huge_pages_(huge_pages) {}

  c10::DataPtr allocate(size_t nbytes) override {
    if (nbytes < threshold_ || !active_.load(std::memory_order_relaxed)) {
      return smaller_->allocate(nbytes);
    }
    const size_t wanted = size_class(nbytes);
    void* block = take_cached(wanted);
    if (block == nullptr) {
      block = map_block(wanted);
    }
    return {block, block, &free_block, c10::Device(c10::DeviceType::CPU)};
  }

  c10::DeleterFnPtr raw_deleter() const override {
    // raw_allocate's pointers of either size come back through free_block, which passes the
    // smaller ones on; without a raw deleter below, there is none here either.
    return smaller_->raw_deleter() == nullptr ? nullptr : &free_block;
  }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

  static void free_block(void* block);

  // `nbytes` rounded up to whole pages and to one of eight sizes per power of two (at most 1/8
  // more, ~1/16 on average), so that requests of nearly the same size (a prefill's activations for
  // 512 or 530 tokens, a KV cache a few columns longer) take each other's freed blocks instead of
  // each mapping and faulting a block of its own.
  static size_t size_class(size_t nbytes) {
    size_t pages = (nbytes + kPageBytes - 1) / kPageBytes;
    if (pages > 8) {
      size_t step = 1;
      while ((pages - 1) / step >= 16) {  // the top four bits of pages - 1 are kept
        step *= 2;
      }
      pages = ((pages + step - 1) / step) * step;
    }
    return pages * kPageBytes;
  }

  size_t release() {
    std::vector<std::pair<size_t, void*>> unmapped;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      for (auto& [size, cached] : cached_) {
        unmapped.emplace_back(size, cached);
      }
      cached_.clear();
      cached_bytes_ = 0;
      peak_live_bytes_ = live_bytes_;  // a new phase: its own peak
    }
    size_t released = 0;
    for (auto& [size, cached] : unmapped) {
      munmap(cached, size);
      released += size;
    }
    return released;
  }

  void set_active(bool active) { active_.store(active, std::memory_order_relaxed); }

  void set_limit(size_t limit) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      limit_ = limit;
      if (cached_bytes_ <= limit_) {
        return;
      }
    }
    release();
  }

  void stats(uint64_t* out) {
    std::lock_guard<std::mutex> lock(mutex_);
    out[0] = cached_bytes_;
    out[1] = live_bytes_;
    out[2] = hits_;
    out[3] = misses_;
    out[4] = limit_;
    out[5] = threshold_;
  }

 private:
  // A block of `wanted` bytes with its pages already resident, or nullptr (a miss).
  //
  // The smallest cached block that fits: as it is when it has at most an eighth to spare. A larger
  // one is cut to `wanted` (its tail unmapped) only when a new mapping would pass the peak below;
  // with room under it, the larger block waits for a request of its own size (a decode step's
  // 3 MB and 6 MB blocks cut each other down every step otherwise). On a miss, cached blocks are
  // unmapped first, largest
  // first, until live and cached bytes plus the new block are within slack_ of the peak that
  // live bytes alone have reached since the last release(): the process's peak without the cache.
  // Only that many: a miss that evicted `wanted` bytes whatever the headroom made a decode step's
  // blocks of a few repeating sizes evict each other every step.
  void* take_cached(size_t wanted) {
    std::vector<std::pair<size_t, void*>> unmapped;
    void* block = nullptr;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto found = cached_.lower_bound(wanted);
      const bool fits = found != cached_.end() && found->first <= wanted + wanted / 8;
      const bool room = live_bytes_ + cached_bytes_ + wanted <= peak_live_bytes_ + slack_;
      if (fits || (found != cached_.end() && !room)) {
        ++hits_;
        const size_t size = found->first;
        block = found->second;
        cached_.erase(found);
        cached_bytes_ -= size;
        if (size > wanted + wanted / 8) {
          unmapped.emplace_back(size - wanted, static_cast<char*>(block) + wanted);
        }
        const size_t kept = unmapped.empty() ? size : wanted;
        live_[block] = kept;
        live_bytes_ += kept;
        peak_live_bytes_ = std::max(peak_live_bytes_, live_bytes_);
      } else {
        ++misses_;
        while (!cached_.empty() && live_bytes_ + cached_bytes_ + wanted > peak_live_bytes_ + slack_) {
          auto largest = std::prev(cached_.end());
          unmapped.emplace_back(largest->first, largest->second);
          cached_bytes_ -= largest->first;
          cached_.erase(largest);
        }
      }
    }
    for (auto& [size, address] : unmapped) {
      munmap(address, size);
    }
    return block;
  }

  void* map_block(size_t size) {
    void* block = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (block == MAP_FAILED) {
      release();  // what waits in the cache may be what the system lacks
      block = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    }
    TORCH_CHECK_WITH(OutOfMemoryError, block != MAP_FAILED,
                     "block_cache: could not map ", size, " bytes for a CPU tensor");
    if (huge_pages_) {
      madvise(block, size, MADV_HUGEPAGE);  // as torch's THP_MEM_ALLOC_ENABLE does
    }
    std::lock_guard<std::mutex> lock(mutex_);
    live_[block] = size;
    live_bytes_ += size;
    peak_live_bytes_ = std::max(peak_live_bytes_, live_bytes_);
    return block;
  }

  // Caches or unmaps one of this allocator's blocks; false if the block is not one of them.
  bool give_back(void* block) {
    size_t size = 0;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto found = live_.find(block);
      if (found == live_.end()) {
        return false;
      }
      size = found->second;
      live_.erase(found);
      live_bytes_ -= size;
      if (active_.load(std::memory_order_relaxed) && cached_bytes_ + size <= limit_) {
        cached_.emplace(size, block);
        cached_bytes_ += size;
        return true;
      }
    }
    munmap(block, size);
    return true;
  }

  c10::Allocator* smaller_;
  const size_t threshold_;
  size_t limit_;
  // How far live and cached bytes may pass the live peak: blocks of one size do not serve
  // another, so a decode step's sampling needs some 15 MB more of its 3 MB and 6 MB blocks cached
  // than its live peak to stop missing (two misses, 9 MB faulted, every step with no slack).
  const size_t slack_;
  const bool huge_pages_;
  std::atomic<bool> active_{false};
  std::mutex mutex_;
  std::multimap<size_t, void*> cached_;  // freed blocks by size, still mapped and touched
  std::unordered_map<void*, size_t> live_;  // handed-out blocks and their mapped sizes
  size_t cached_bytes_ = 0;
  size_t live_bytes_ = 0;
  size_t peak_live_bytes_ = 0;  // the most live bytes since the last release()
  uint64_t hits_ = 0;
  uint64_t misses_ = 0;
};

BlockCache* installed = nullptr;

void BlockCache::free_block(void* block) {
  if (block == nullptr) {
    return;
  }
  if (!installed->give_back(block)) {
    installed->smaller_->raw_deleter()(block);  // a smaller block from raw_allocate
  }
}

}  // namespace

extern "C" {

// Makes the cache torch's CPU allocator; 1 if it is (now or already), 0 where an allocator of a
// higher priority keeps its place. Installed once per process: its blocks outlive any switch back.
int cookbook_block_cache_install(uint64_t threshold, uint64_t limit, uint64_t slack, int huge_pages) {
  if (installed == nullptr) {
    c10::Allocator* previous = c10::GetCPUAllocator();
    installed = new BlockCache(previous, threshold, limit, slack, huge_pages != 0);
    c10::SetCPUAllocator(installed, /*priority=*/1);
  }
  return c10::GetCPUAllocator() == installed ? 1 : 0;
}

uint64_t cookbook_block_cache_release() { return installed == nullptr ? 0 : installed->release(); }

// Whether blocks of the threshold's size or more come from the cache (1) or from the allocator
// before it (0, the state after install). Blocks freed while it is off are unmapped, not kept.
void cookbook_block_cache_set_active(int active) {
  if (installed != nullptr) {
    installed->set_active(active != 0);
  }
}

void cookbook_block_cache_set_limit(uint64_t limit) {
  if (installed != nullptr) {
    installed->set_limit(limit);
  }
}

// cached bytes, live bytes, hits, misses, limit, threshold.
void cookbook_block_cache_stats(uint64_t* out) {
  if (installed == nullptr) {
    for (int i = 0; i < 6; ++i) out[i] = 0;
    return;
  }
  installed->stats(out);
}

}  // extern "C"

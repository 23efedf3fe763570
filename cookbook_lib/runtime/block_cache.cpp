// torch's CPU allocator with a bounded cache of freed large blocks (runtime/block_cache.py builds
// and loads it).
//
// Why: torch's default CPU allocator hands every tensor to malloc. Within a training step glibc
// would reuse freed activations from its arenas, but their holes fragment the heap by ~1 GB, so a
// step maps each block of 256 KB or more on its own (runtime/memory.py) and every page of it
// faults again on first touch: a third of a demo step's user time went to the kernel. Here a
// freed block of `threshold` bytes or more keeps its pages and is handed to the next allocation
// that fits in it (cut to size when much larger), as CUDA's caching allocator does; no heap lies
// around it to fragment. A miss unmaps cached blocks before it maps, so the cache never raises
// the process's peak. At most `limit` bytes wait in the cache (a freed block that would pass it
// is unmapped at once), and release() unmaps them all, between the phases of a run. Smaller
// blocks go to the allocator that was in place before, unchanged.

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>
#include <sys/mman.h>

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
  BlockCache(c10::Allocator* smaller, size_t threshold, size_t limit, bool huge_pages)
      : smaller_(smaller), threshold_(threshold), limit_(limit), huge_pages_(huge_pages) {}

  c10::DataPtr allocate(size_t nbytes) override {
    if (nbytes < threshold_) {
      return smaller_->allocate(nbytes);
    }
    const size_t wanted = (nbytes + kPageBytes - 1) / kPageBytes * kPageBytes;
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

  size_t release() {
    std::vector<std::pair<size_t, void*>> unmapped;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      for (auto& [size, cached] : cached_) {
        unmapped.emplace_back(size, cached);
      }
      cached_.clear();
      cached_bytes_ = 0;
    }
    size_t released = 0;
    for (auto& [size, cached] : unmapped) {
      munmap(cached, size);
      released += size;
    }
    return released;
  }

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
  // The smallest cached block that fits: as it is when it has at most an eighth to spare, else
  // cut to `wanted` (its tail unmapped). On a miss, cached blocks of at least `wanted` bytes in
  // all are unmapped first, largest first, so that the caller's new mapping does not add to what
  // is resident: live and cached bytes together never pass the peak that live bytes alone reach,
  // i.e. the process's peak without the cache.
  void* take_cached(size_t wanted) {
    std::vector<std::pair<size_t, void*>> unmapped;
    void* block = nullptr;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto found = cached_.lower_bound(wanted);
      if (found != cached_.end()) {
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
      } else {
        ++misses_;
        size_t freed = 0;
        while (freed < wanted && !cached_.empty()) {
          auto largest = std::prev(cached_.end());
          unmapped.emplace_back(largest->first, largest->second);
          freed += largest->first;
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
      if (cached_bytes_ + size <= limit_) {
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
  const bool huge_pages_;
  std::mutex mutex_;
  std::multimap<size_t, void*> cached_;  // freed blocks by size, still mapped and touched
  std::unordered_map<void*, size_t> live_;  // handed-out blocks and their mapped sizes
  size_t cached_bytes_ = 0;
  size_t live_bytes_ = 0;
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
int cookbook_block_cache_install(uint64_t threshold, uint64_t limit, int huge_pages) {
  if (installed == nullptr) {
    c10::Allocator* previous = c10::GetCPUAllocator();
    installed = new BlockCache(previous, threshold, limit, huge_pages != 0);
    c10::SetCPUAllocator(installed, /*priority=*/1);
  }
  return c10::GetCPUAllocator() == installed ? 1 : 0;
}

uint64_t cookbook_block_cache_release() { return installed == nullptr ? 0 : installed->release(); }

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

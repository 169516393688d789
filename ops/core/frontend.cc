#include "frontend.h"

#include "global.h"

namespace kerasdist::core {

RuntimeRef RuntimeRef::Current(int process_set) {
  RuntimeRef r;
  r.rt_ = CurrentRuntime();
  r.process_set_ = process_set;
  return r;
}

Status RuntimeRef::Enqueue(Entry entry) {
  if (process_set_ == 0) return rt_->Enqueue(std::move(entry));
  std::shared_ptr<Runtime> rt;
  KD_RETURN_IF_ERROR(RuntimeForSet(process_set_, &entry.req, &rt));
  return rt->Enqueue(std::move(entry));
}

Status RuntimeRef::EnqueueMany(std::vector<Entry>& entries, size_t* queued) {
  if (process_set_ == 0 || entries.empty())
    return rt_->EnqueueMany(entries, queued);
  *queued = 0;
  std::shared_ptr<Runtime> rt;
  // A group is allreduces: no root to translate, one set for all.
  KD_RETURN_IF_ERROR(RuntimeForSet(process_set_, &entries[0].req, &rt));
  return rt->EnqueueMany(entries, queued);
}

const DeviceStreamHooks* DeviceHooks() {
  const DeviceStreamHooks& h = RegisteredDeviceHooks();
  return h.record_event ? &h : nullptr;
}

}  // namespace kerasdist::core

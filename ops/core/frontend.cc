#include "frontend.h"

#include "global.h"

namespace kerasdist::core {

RuntimeRef RuntimeRef::Current() {
  RuntimeRef r;
  r.rt_ = CurrentRuntime();
  return r;
}

Status RuntimeRef::Enqueue(Entry entry) {
  return rt_->Enqueue(std::move(entry));
}

Status RuntimeRef::EnqueueMany(std::vector<Entry>& entries, size_t* queued) {
  return rt_->EnqueueMany(entries, queued);
}

const DeviceStreamHooks* DeviceHooks() {
  const DeviceStreamHooks& h = RegisteredDeviceHooks();
  return h.record_event ? &h : nullptr;
}

}  // namespace kerasdist::core

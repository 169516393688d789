#include "device_hooks.h"

namespace kerasdist::core {

DeviceStreamHooks& RegisteredDeviceHooks() {
  static DeviceStreamHooks hooks;
  return hooks;
}

const DeviceStreamHooks* DeviceHooks() {
  const DeviceStreamHooks& h = RegisteredDeviceHooks();
  return h.record_event ? &h : nullptr;
}

}  // namespace kerasdist::core

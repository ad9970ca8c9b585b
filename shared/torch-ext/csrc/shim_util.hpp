// What every C entry point of the shim shares: reporting a failure as a status code plus a malloc'd message
// (freed by the caller with jetrl_free_string), and running a body with every exception turned into one.
#pragma once

#include <cstdlib>
#include <cstring>
#include <exception>
#include <string>

#include <c10/util/Exception.h>

#include "torch_ext.h"

namespace jetrl_shim {

// A malloc'd copy of `message` (NULL when the allocation fails).
inline char* copy_message(const std::string& message) {
  char* out = static_cast<char*>(std::malloc(message.size() + 1));
  if (out != nullptr) {
    std::memcpy(out, message.data(), message.size());
    out[message.size()] = '\0';
  }
  return out;
}

// Stores `message` in `*err` (when `err` is not NULL) and returns `code`.
inline int fail(char** err, int code, const std::string& message) {
  if (err != nullptr) *err = copy_message(message);
  return code;
}

// Runs `body`; any exception becomes JETRL_ERR with its message.
template <typename F>
int guarded(char** err, F&& body) {
  try {
    body();
    return JETRL_OK;
  } catch (const c10::Error& e) {
    return fail(err, JETRL_ERR, e.what_without_backtrace());
  } catch (const std::exception& e) {
    return fail(err, JETRL_ERR, e.what());
  } catch (...) {
    return fail(err, JETRL_ERR, "unknown C++ exception");
  }
}

}  // namespace jetrl_shim

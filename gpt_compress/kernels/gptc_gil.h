// The Python GIL while an op computes (GilRelease).
//
// Paddle's Python binding of Predictor.run keeps the GIL for the whole run, so while a program
// runs no other thread of the process runs Python: a server's HTTP loop stalls behind every
// decode step, and a step waits for the loop's switch interval to get the GIL back. The ops touch
// no Python object, so each one releases the GIL for its compute, as numpy's and onnxruntime's
// kernels do, and takes it back before returning (or unwinding) to Paddle. The Python API is
// looked up in the process at run time: a C++ deployment without Python finds none and the guard
// does nothing; so does a thread that does not hold the GIL (an executor's worker thread).
#ifndef GPTC_KERNELS_GPTC_GIL_H_
#define GPTC_KERNELS_GPTC_GIL_H_

#include <dlfcn.h>

namespace {

struct PythonApi {
  int (*initialized)() = nullptr;   // Py_IsInitialized
  int (*holds_gil)() = nullptr;     // PyGILState_Check
  void* (*save)() = nullptr;        // PyEval_SaveThread
  void (*restore)(void*) = nullptr; // PyEval_RestoreThread

  static const PythonApi& get() {
    static const PythonApi api = [] {
      PythonApi a;
      a.initialized = reinterpret_cast<int (*)()>(dlsym(RTLD_DEFAULT, "Py_IsInitialized"));
      a.holds_gil = reinterpret_cast<int (*)()>(dlsym(RTLD_DEFAULT, "PyGILState_Check"));
      a.save = reinterpret_cast<void* (*)()>(dlsym(RTLD_DEFAULT, "PyEval_SaveThread"));
      a.restore = reinterpret_cast<void (*)(void*)>(dlsym(RTLD_DEFAULT, "PyEval_RestoreThread"));
      if (!a.initialized || !a.holds_gil || !a.save || !a.restore) a = PythonApi();
      return a;
    }();
    return api;
  }
};

// Releases the GIL from construction to destruction when the calling thread holds it.
class GilRelease {
 public:
  GilRelease() {
    const PythonApi& py = PythonApi::get();
    if (py.save && py.initialized() && py.holds_gil()) state_ = py.save();
  }
  ~GilRelease() {
    if (state_) PythonApi::get().restore(state_);
  }
  GilRelease(const GilRelease&) = delete;
  GilRelease& operator=(const GilRelease&) = delete;

 private:
  void* state_ = nullptr;
};

}  // namespace

#endif  // GPTC_KERNELS_GPTC_GIL_H_

// libllmpipe_ops.so: libllmpipe_ops.a whole, as one shared library (native/CMakeLists.txt). Loading it registers every
// operator of ours in the process's ExecuTorch runtime; its C interface is include/llmpipe/llmpipe_ops.h.

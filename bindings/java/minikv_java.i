/* minikv_java.i — the Java module of the SWIG core: package-private low-level classes
 * (dev.minikv.MinikvNative, MinikvNativeJNI, CacheHandle, ConfigStruct, MemoryStatsStruct)
 * that KvCache and Config wrap. Generated at build time by CMake (swig_add_library); nothing
 * generated is committed. */
%module(jniclassname="MinikvNativeJNI") MinikvNative

/* Failed calls throw dev.minikv.MinikvException(int status, String message). */
%{
#define MINIKV_JAVA_EXCEPTION "dev/minikv/MinikvException"
%}

/* Enums as plain int constants: the public enums (Status, Dtype, ...) live in KvCache's
 * package and are converted there. */
%include "enumtypeunsafe.swg"
%javaconst(1);

/* Keep the low-level layer out of the public API: package-private classes, and proxies
 * whose memory is released explicitly (KvCache.close), never by a finalizer. */
%pragma(java) moduleclassmodifiers="final class"
%pragma(java) jniclassclassmodifiers="final class"
%typemap(javaclassmodifiers) SWIGTYPE, enum SWIGTYPE "final class"
%typemap(javafinalize) SWIGTYPE ""

/* Load the JNI library once, with a message that says how to fix a failure. Set
 * -Dminikv.jni.library=/path/to/libminikv_jni.so to load a specific file. */
%pragma(java) jniclasscode=%{
  static {
    String path = System.getProperty("minikv.jni.library");
    try {
      if (path != null && !path.isEmpty()) {
        System.load(path);
      } else {
        System.loadLibrary("minikv_jni");
      }
    } catch (UnsatisfiedLinkError e) {
      UnsatisfiedLinkError wrapped = new UnsatisfiedLinkError(
          "libminikv's JNI library could not be loaded (" + e.getMessage() + "); put "
          + "libminikv_jni and libminikv on java.library.path / LD_LIBRARY_PATH, or set "
          + "-Dminikv.jni.library=/path/to/libminikv_jni.so");
      wrapped.initCause(e);
      throw wrapped;
    }
  }
%}

%include "../swig/minikv_core.i"

/* A direct buffer's address, for passing host memory through the address (long) path. */
%typemap(jni) const void *DIRECT_BUFFER "jobject"
%typemap(jtype) const void *DIRECT_BUFFER "java.nio.Buffer"
%typemap(jstype) const void *DIRECT_BUFFER "java.nio.Buffer"
%typemap(javain) const void *DIRECT_BUFFER "$javainput"
%typemap(in) const void *DIRECT_BUFFER %{
  $1 = $input ? (*jenv)->GetDirectBufferAddress(jenv, $input) : NULL;
  if (!$1) {
    SWIG_JavaThrowException(jenv, SWIG_JavaIllegalArgumentException,
                            "not a direct buffer (use ByteBuffer.allocateDirect)");
    return $null;
  }
%}
%typemap(jni) intptr_t buffer_address "jlong"
%typemap(jtype) intptr_t buffer_address "long"
%typemap(jstype) intptr_t buffer_address "long"
%typemap(javaout) intptr_t buffer_address { return $jnicall; }
%typemap(out) intptr_t buffer_address %{ $result = (jlong)$1; %}
%rename("%s") buffer_address;
%inline %{
static intptr_t buffer_address(const void *DIRECT_BUFFER) { return (intptr_t)DIRECT_BUFFER; }
%}

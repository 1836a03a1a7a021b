# minikv_choose_cuda(<request> <out_var> <why_var>): whether to build the CUDA backend for
# MINIKV_CUDA = AUTO | ON | OFF, and why (for the configure step's status line). AUTO builds
# it when a CUDA compiler is found and this CMake can use its toolkit; ON requires both.
include(CheckLanguage)

function(minikv_choose_cuda request out_var why_var)
  string(TOUPPER "${request}" request)
  if(NOT request MATCHES "^(AUTO|ON|OFF)$")
    message(FATAL_ERROR "MINIKV_CUDA must be AUTO, ON or OFF (got '${request}')")
  endif()
  set(${out_var} OFF PARENT_SCOPE)
  if(request STREQUAL "OFF")
    set(${why_var} "MINIKV_CUDA=OFF" PARENT_SCOPE)
    return()
  endif()
  if(NOT CMAKE_CUDA_COMPILER)
    check_language(CUDA)
  endif()
  if(NOT CMAKE_CUDA_COMPILER)
    set(why "no CUDA compiler found: put nvcc on PATH or set CMAKE_CUDA_COMPILER")
  else()
    # Debian 12's CMake 3.25.1 FindCUDAToolkit sets a property on CUDA::nvToolsExt without
    # checking that the target exists, and CUDA >= 13 ships no libnvToolsExt: configuring
    # the backend would be a hard error. Later CMake releases (pip install cmake) are fixed.
    get_filename_component(toolkit "${CMAKE_CUDA_COMPILER}" DIRECTORY)
    get_filename_component(toolkit "${toolkit}" DIRECTORY)
    file(READ "${CMAKE_ROOT}/Modules/FindCUDAToolkit.cmake" module)
    string(FIND "${module}" "if(CMAKE_MINIMUM_REQUIRED_VERSION VERSION_GREATER_EQUAL 3.25)" clash)
    file(GLOB nvtx "${toolkit}/lib64/libnvToolsExt*" "${toolkit}/lib/libnvToolsExt*")
    if(clash GREATER_EQUAL 0 AND NOT nvtx)
      set(why "CMake ${CMAKE_VERSION}'s FindCUDAToolkit fails on a CUDA toolkit without "
              "libnvToolsExt (CUDA >= 13): use a newer CMake (pip install cmake)")
      string(CONCAT why ${why})
    else()
      set(${out_var} ON PARENT_SCOPE)
      if(request STREQUAL "ON")
        set(${why_var} "MINIKV_CUDA=ON: ${CMAKE_CUDA_COMPILER}" PARENT_SCOPE)
      else()
        set(${why_var} "AUTO found ${CMAKE_CUDA_COMPILER}; -DMINIKV_CUDA=OFF for a CPU-only build"
            PARENT_SCOPE)
      endif()
      return()
    endif()
  endif()
  if(request STREQUAL "ON")
    message(FATAL_ERROR "MINIKV_CUDA=ON but ${why}")
  endif()
  set(${why_var} "AUTO: ${why}; the CPU backend only" PARENT_SCOPE)
endfunction()

# cmake -P script: compile every .java under SOURCE_DIRS into CLASS_DIR (fresh), then either
# pack CLASS_DIR into JAR_FILE or touch STAMP. Globbing here, at build time, picks up the
# classes SWIG generated without listing them in CMakeLists.txt.
#   -DJAVAC= -DSOURCE_DIRS=a;b -DCLASS_DIR= [-DCLASSPATH=] [-DSTAMP=]
#   [-DJAR= -DJAR_FILE= [-DMANIFEST=file] [-DMETA_INF_FILES=a;b (copied into META-INF/)]]
set(sources)
foreach(dir IN LISTS SOURCE_DIRS)
  file(GLOB_RECURSE found ${dir}/*.java)
  list(APPEND sources ${found})
endforeach()
if(NOT sources)
  message(FATAL_ERROR "no .java files under ${SOURCE_DIRS}")
endif()
file(REMOVE_RECURSE ${CLASS_DIR})
file(MAKE_DIRECTORY ${CLASS_DIR})
set(cp_args)
if(CLASSPATH)
  set(cp_args -classpath ${CLASSPATH})
endif()
execute_process(
  COMMAND ${JAVAC} -Xlint:all -Xlint:-serial -Werror --release 17 -encoding UTF-8 ${cp_args}
          -d ${CLASS_DIR} ${sources}
  RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "javac failed (${rc})")
endif()
if(JAR_FILE)
  if(META_INF_FILES)
    file(COPY ${META_INF_FILES} DESTINATION ${CLASS_DIR}/META-INF)
  endif()
  set(manifest_args)
  if(MANIFEST)
    set(manifest_args --manifest ${MANIFEST})
  endif()
  execute_process(COMMAND ${JAR} --create --file ${JAR_FILE} ${manifest_args} -C ${CLASS_DIR} .
                  RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "jar failed (${rc})")
  endif()
endif()
if(STAMP)
  file(TOUCH ${STAMP})
endif()
